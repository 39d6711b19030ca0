-- >>> stasis >>>
-- Added by `stasis slurm install`; `stasis slurm uninstall` takes it out again. For batch jobs
-- opted in with STASIS_ENABLE=1 (or CEDANA_ENABLE=1) it asks for what stasis needs:
--   --requeue               a checkpointed job comes back
--   --signal=B:URG@N        the batch step's launcher hears of preemption and of the time limit
--                           N seconds ahead (at most a sixth of the time limit) and checkpoints;
--                           URG because its default action is to be ignored: a job that lands
--                           on a node without stasis runs on exactly as without it
--   --open-mode=append      the requeued job keeps appending to the same output file
-- Every other job is left as it is. A site's own slurm_cli_pre_submit above still runs, after this.
local stasis_site_pre_submit = slurm_cli_pre_submit
local stasis_warn_s = @WARN_S@

local function stasis_truthy(v)
  return v ~= nil and v ~= "" and v ~= "0" and v ~= "false" and v ~= "no"
end

local function stasis_opted_in(options)
  local export = options["export"]
  if export ~= nil and export ~= "" then
    local from_env = false
    for item in string.gmatch(export, "[^,]+") do
      local k, v = string.match(item, "^%s*([%w_]+)=(.*)$")
      if k == "STASIS_ENABLE" or k == "CEDANA_ENABLE" then
        return stasis_truthy(v)
      end
      local name = string.match(item, "^%s*([%w_]+)%s*$")
      if name == "ALL" or name == "STASIS_ENABLE" or name == "CEDANA_ENABLE" then
        from_env = true
      end
    end
    if not from_env then
      return false
    end
  end
  return stasis_truthy(os.getenv("STASIS_ENABLE")) or stasis_truthy(os.getenv("CEDANA_ENABLE"))
end

-- Minutes in a Slurm time string (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); nil if not one.
local function stasis_minutes(t)
  if t == nil or t == "" then
    return nil
  end
  local days, rest = string.match(t, "^(%d+)-(.*)$")
  local parts = {}
  for p in string.gmatch(rest or t, "[^:]+") do
    local n = tonumber(p)
    if n == nil then
      return nil
    end
    parts[#parts + 1] = n
  end
  if days ~= nil then
    return tonumber(days) * 1440 + (parts[1] or 0) * 60 + (parts[2] or 0) + (parts[3] or 0) / 60
  end
  if #parts == 1 then
    return parts[1]
  elseif #parts == 2 then
    return parts[1] + parts[2] / 60
  elseif #parts == 3 then
    return parts[1] * 60 + parts[2] + parts[3] / 60
  end
  return nil
end

local function stasis_set(options, key, value)
  pcall(function() options[key] = value end)
end

function slurm_cli_pre_submit(options, pack_offset)
  -- Only sbatch makes a batch step; srun and salloc are left alone.
  if options["type"] == "sbatch" and stasis_opted_in(options) then
    stasis_set(options, "requeue", "1")
    stasis_set(options, "open-mode", "append")
    local signal = options["signal"]
    if signal == nil or signal == "" or signal == "0@0" then
      local warn = stasis_warn_s
      local limit = stasis_minutes(options["time"])
      -- Slurm checks limits every 30 s and may signal up to that much earlier than asked:
      -- for short limits keep the warning at a sixth of the limit so that each run gets work done.
      if limit ~= nil and limit > 0 and warn > limit * 10 then
        warn = math.max(5, math.floor(limit * 10))
      end
      stasis_set(options, "signal", "B:URG@" .. warn)
    end
  end
  if stasis_site_pre_submit ~= nil then
    return stasis_site_pre_submit(options, pack_offset)
  end
  return slurm.SUCCESS
end

if slurm_cli_setup_defaults == nil then
  function slurm_cli_setup_defaults(options, early_pass)
    return slurm.SUCCESS
  end
end

if slurm_cli_post_submit == nil then
  function slurm_cli_post_submit(offset, job_id, step_id)
    return slurm.SUCCESS
  end
end
-- <<< stasis <<<
