-- >>> stasis >>>
-- Added by `stasis slurm install`; `stasis slurm uninstall` takes it out again. Jobs opted in with
-- STASIS_ENABLE=1 (or CEDANA_ENABLE=1) are made requeueable, so that a job stasis checkpointed
-- comes back and resumes, and get a token in their AdminComment ("stasis-token=...") that tells
-- their checkpoints apart from those of an unrelated job that later reuses the job id (job ids
-- restart when slurmctld starts clean). A job on several nodes cannot be checkpointed (yet): unless
-- the site turned on slurm_multinode (stasis's setting, written below by `stasis slurm install`),
-- an opted-in job that asks for more than one node is refused with the reason, and one that does
-- not is kept to one node; with it on, such a job runs across its nodes, each node's tasks in the
-- job's own network. Every other job is left as it is. A site's own slurm_job_submit above still
-- runs, after this.
local stasis_site_job_submit = slurm_job_submit
local stasis_multinode = @MULTINODE@

local function stasis_truthy(v)
  return v ~= nil and v ~= "" and v ~= "0" and v ~= "false" and v ~= "no"
end

local function stasis_opted_in(job_desc)
  local ok, env = pcall(function() return job_desc.environment end)
  if not ok or env == nil then
    return false
  end
  return stasis_truthy(env["STASIS_ENABLE"]) or stasis_truthy(env["CEDANA_ENABLE"])
end

local function stasis_set_nodes(value)
  return value ~= nil and value ~= slurm.NO_VAL and value ~= 0
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  if stasis_opted_in(job_desc) then
    local min_nodes, max_nodes = job_desc.min_nodes, job_desc.max_nodes
    local several = (stasis_set_nodes(min_nodes) and min_nodes > 1) or
                    (stasis_set_nodes(max_nodes) and max_nodes > 1)
    if several and stasis_multinode == 0 then
      slurm.log_user("stasis: this job asks for several nodes, and stasis cannot checkpoint a " ..
                     "job that spans nodes yet, so such jobs are off on this cluster (stasis " ..
                     "setting slurm_multinode = 0); submit it on one node (-N 1), without " ..
                     "STASIS_ENABLE=1, or ask the site to set slurm_multinode")
      return slurm.ERROR
    end
    if stasis_multinode == 0 then
      job_desc.max_nodes = 1
    end
    job_desc.requeue = 1
    local comment = job_desc.admin_comment
    if comment == nil or not string.find(comment, "stasis-token=", 1, true) then
      local token = "stasis-token=" .. os.time() .. "-" .. math.random(1000000000)
      if comment ~= nil and comment ~= "" then
        token = comment .. " " .. token
      end
      job_desc.admin_comment = token
    end
  end
  if stasis_site_job_submit ~= nil then
    return stasis_site_job_submit(job_desc, part_list, submit_uid)
  end
  return slurm.SUCCESS
end

if slurm_job_modify == nil then
  function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
  end
end
-- <<< stasis <<<
