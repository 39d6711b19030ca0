/*
 * stasis_spank.c: the SPANK plugin of stasis' Slurm integration.
 *
 * Built at install time against the installed <slurm/spank.h>:
 *     gcc -shared -fPIC -O2 -o stasis_spank.so stasis_spank.c
 * Loaded by slurmstepd from plugstack.conf as
 *     optional /path/stasis_spank.so python=PY launcher=PATH [conf=TOML] [slurm_conf=PATH]
 *              [multinode=1]
 * A "%n" in conf= is the name of the node it runs on (SLURMD_NODENAME): several slurmd of one
 * slurm.conf on one machine (the local cluster's nodes) each have their own stasis daemon.
 *
 * It acts only in the batch step of jobs opted in with STASIS_ENABLE=1 (or CEDANA_ENABLE=1):
 *   task_init_privileged (root, in the task process, before it execs the batch script):
 *     becomes a child subreaper and runs `PY -I -m stasis.slurm.taskinit` (root). That helper
 *     restores the job's latest checkpoint, whose namespace init ends up a child of this task
 *     (exit 0), or asks for a fresh start (exit 10: we unshare a PID and an IPC namespace, so the launcher's
 *     first child is the init of a new namespace, and a mount namespace with a devpts of the job's
 *     own: stasis/engine/privatepts.py), or says the job runs unprotected (exit 11).
 *     Its stdout (one JSON object) is handed to the launcher in STASIS_SLURM_START.
 *   task_init (the job's user): saves the batch script's path in STASIS_SLURM_SCRIPT and makes
 *     the task exec the launcher instead, which runs or adopts the workload and asks the node
 *     daemon for checkpoints on SIGURG (or SIGUSR1).
 * Any failure leaves the job to run exactly as without stasis, with a warning in its output.
 *
 * A job on several nodes (slurm_multinode set, issue 31) has a network of its own on each node:
 *   job_prolog / job_epilog (root, slurmd's prolog and epilog on every node of the allocation):
 *     run `PY -I -m stasis.slurm.jobnetnode prolog|epilog`, which makes the node's part of the
 *     job's network (and records its VXLAN id in /run/stasis-jobnet/<job id>), or removes it.
 *   task_init_privileged, every task of every step of such a job (batch, srun's, the prted that
 *     Open MPI's mpirun starts through srun): setns() into that network before the task execs.
 *     Here, not in a helper process: a namespace can only be entered by the process itself, and
 *     this is the last point where the task is still root; stasis' own task init (taskinit, a
 *     child) runs before it, in the node's network, where the store and the daemon are.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

SPANK_PLUGIN(stasis, 1);

#define HELPER_OUTPUT_MAX 65536
#define EXIT_RESTORED 0
#define EXIT_FRESH 10
#define EXIT_OFF 11
/* Where slurmd keeps the configuration it fetched in configless mode (Slurm 22.05 and later). */
#define CONFIGLESS_CACHE "/run/slurm/conf/slurm.conf"
/* Where stasis.slurm.jobnetnode records a multi-node job's VXLAN id (root's, per node). */
#define JOBNET_RECORDS "/run/stasis-jobnet"
/* stasis.engine.privatepts's SOURCE and OPTIONS (tty's gid is 5 on Debian). */
#define PTS_SOURCE "stasis-devpts"
#define PTS_OPTIONS "newinstance,ptmxmode=0666,mode=0620,gid=5"
/* How long the epilog waits for the job's extern step to be gone (wait_extern_step_gone). */
#define EXTERN_WAIT_S 30

static char python[1024] = "";
static char launcher[1024] = "";
static char conf[1024] = "";
static char slurm_conf[1024] = "";
static int multinode = 0; /* slurm_multinode is set: jobs may span nodes */
static int started = 0; /* this task is under stasis (restored or fresh) */

static void parse_args(int ac, char **av)
{
    for (int i = 0; i < ac; i++) {
        const char *a = av[i];
        if (!strncmp(a, "python=", 7))
            snprintf(python, sizeof(python), "%s", a + 7);
        else if (!strncmp(a, "launcher=", 9))
            snprintf(launcher, sizeof(launcher), "%s", a + 9);
        else if (!strncmp(a, "conf=", 5))
            snprintf(conf, sizeof(conf), "%s", a + 5);
        else if (!strncmp(a, "slurm_conf=", 11))
            snprintf(slurm_conf, sizeof(slurm_conf), "%s", a + 11);
        else if (!strcmp(a, "multinode=1"))
            multinode = 1;
        else
            slurm_error("stasis: unknown plugstack argument %s", a);
    }
}

static int truthy(const char *v)
{
    return v[0] && strcmp(v, "0") && strcasecmp(v, "false") && strcasecmp(v, "no");
}

/* Whether this is the batch step of a job that opted in. */
static int opted_in(spank_t sp)
{
    uint32_t stepid = 0;
    char buf[64];

    if (!spank_remote(sp))
        return 0;
    if (spank_get_item(sp, S_JOB_STEPID, &stepid) != ESPANK_SUCCESS ||
        stepid != SLURM_BATCH_SCRIPT)
        return 0;
    if (spank_getenv(sp, "STASIS_ENABLE", buf, sizeof(buf)) == ESPANK_SUCCESS && truthy(buf))
        return 1;
    if (spank_getenv(sp, "CEDANA_ENABLE", buf, sizeof(buf)) == ESPANK_SUCCESS && truthy(buf))
        return 1;
    return 0;
}

static void set_off(spank_t sp, const char *why)
{
    char json[1200];
    /* `why` is ours (no quotes or backslashes in it). */
    snprintf(json, sizeof(json), "{\"mode\": \"off\", \"messages\": [\"stasis: warning: %s; "
             "this job runs WITHOUT checkpoint protection\"]}", why);
    spank_setenv(sp, "STASIS_SLURM_START", json, 1);
}

/* conf= with each "%n" replaced by this node's name. */
static void node_conf(spank_t sp, char *out, size_t outlen)
{
    char node[256] = "";
    size_t o = 0;

    const char *env_node = getenv("SLURMD_NODENAME"); /* prolog/epilog: the process env */
    if (spank_getenv(sp, "SLURMD_NODENAME", node, sizeof(node)) == ESPANK_SUCCESS && node[0]) {
        /* found */
    } else if (env_node && env_node[0]) {
        snprintf(node, sizeof(node), "%s", env_node);
    } else {
        if (gethostname(node, sizeof(node)) < 0)
            node[0] = '\0';
        node[sizeof(node) - 1] = '\0';
        char *dot = strchr(node, '.');
        if (dot)
            *dot = '\0';
    }
    for (const char *c = conf; *c && o + 1 < outlen; c++) {
        if (c[0] == '%' && c[1] == 'n') {
            o += (size_t)snprintf(out + o, outlen - o, "%s", node);
            if (o >= outlen)
                o = outlen - 1;
            c++;
        } else {
            out[o++] = *c;
        }
    }
    out[o] = '\0';
}

/* Run `PY -I -m <argv...>` as root with a clean environment (STASIS_CONFIG and SLURM_CONF of
 * this node); collect its stdout. Returns its exit code, -1 if it did not run. */
static int run_python(spank_t sp, char **args, char *out, size_t outlen)
{
    char conf_here[1024];
    int fds[2];

    node_conf(sp, conf_here, sizeof(conf_here));
    if (pipe2(fds, O_CLOEXEC) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        sigset_t all;
        char env_conf[1100], env_slurm[1100];
        char *envp[5];
        char *argv[24];
        int n = 0, a = 0;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++)
            signal(s, SIG_DFL);
        dup2(fds[1], 1);
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 2);
        }
        if (chdir("/") < 0)
            _exit(127);
        envp[n++] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
        if (conf_here[0]) {
            snprintf(env_conf, sizeof(env_conf), "STASIS_CONFIG=%s", conf_here);
            envp[n++] = env_conf;
        }
        const char *slurm_here = slurm_conf;
        if (slurm_conf[0] && access(slurm_conf, F_OK) != 0)
            slurm_here = access(CONFIGLESS_CACHE, F_OK) == 0 ? CONFIGLESS_CACHE : "";
        if (slurm_here[0]) {
            snprintf(env_slurm, sizeof(env_slurm), "SLURM_CONF=%s", slurm_here);
            envp[n++] = env_slurm;
        }
        envp[n++] = "LANG=C.UTF-8";
        envp[n] = NULL;
        argv[a++] = python;
        argv[a++] = "-I";
        argv[a++] = "-m";
        for (int i = 0; args[i] && a < 23; i++)
            argv[a++] = args[i];
        argv[a] = NULL;
        execve(python, argv, envp);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fds[0], out + got, outlen - 1 - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
        if (got >= outlen - 1)
            break;
    }
    out[got] = '\0';
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR)
            return -1;
    }
    if (!WIFEXITED(status))
        return -1;
    return WEXITSTATUS(status);
}

/* Run the helper as root with a clean environment; collect its stdout. Returns its exit code. */
static int run_helper(spank_t sp, char *out, size_t outlen)
{
    uint32_t jobid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
    char label[256] = "", fresh[16] = "", jobid_s[32], uid_s[32], gid_s[32];

    spank_get_item(sp, S_JOB_ID, &jobid);
    spank_get_item(sp, S_JOB_UID, &uid);
    spank_get_item(sp, S_JOB_GID, &gid);
    if (spank_getenv(sp, "STASIS_CHECKPOINT", label, sizeof(label)) != ESPANK_SUCCESS &&
        spank_getenv(sp, "CEDANA_CHECKPOINT", label, sizeof(label)) != ESPANK_SUCCESS)
        label[0] = '\0';
    /* STASIS_FRESH=1: start from the beginning rather than be held when stasis cannot tell
     * whether the job has a checkpoint (the helper decides what the value means). */
    if (spank_getenv(sp, "STASIS_FRESH", fresh, sizeof(fresh)) != ESPANK_SUCCESS)
        fresh[0] = '\0';
    snprintf(jobid_s, sizeof(jobid_s), "%u", jobid);
    snprintf(uid_s, sizeof(uid_s), "%u", (unsigned)uid);
    snprintf(gid_s, sizeof(gid_s), "%u", (unsigned)gid);
    char *args[] = {"stasis.slurm.taskinit", "--job-id", jobid_s, "--uid", uid_s, "--gid", gid_s,
                    "--label", label, "--fresh", fresh, NULL};
    return run_python(sp, args, out, outlen);
}

/* The job's id in any context: spank's item, else (prolog/epilog) the process environment. */
static uint32_t job_id(spank_t sp)
{
    uint32_t jobid = 0;
    if (spank_get_item(sp, S_JOB_ID, &jobid) == ESPANK_SUCCESS && jobid)
        return jobid;
    const char *env = getenv("SLURM_JOB_ID");
    return env ? (uint32_t)strtoul(env, NULL, 10) : 0;
}

/* slurmd's prolog/epilog on this node: make or remove the node's part of a multi-node job's
 * network. Never fails the prolog (Slurm would drain the node): the helper says why instead. */
static int jobnet_script(spank_t sp, char *what)
{
    static char out[4096];
    char jobid_s[32], node[256] = "";
    const char *env_node = getenv("SLURMD_NODENAME");

    if (!python[0])
        return ESPANK_SUCCESS;
    snprintf(jobid_s, sizeof(jobid_s), "%u", job_id(sp));
    /* Python only where it has something to do: the prolog with slurm_multinode set, the
     * epilog then or where a prolog recorded a network (the setting turned off meanwhile). */
    char record[128];
    snprintf(record, sizeof(record), JOBNET_RECORDS "/%s", jobid_s);
    if (!multinode && (!strcmp(what, "prolog") || access(record, F_OK) != 0))
        return ESPANK_SUCCESS;
    if (env_node)
        snprintf(node, sizeof(node), "%s", env_node);
    char *args[] = {"stasis.slurm.jobnetnode", what, "--job-id", jobid_s, "--node", node, NULL};
    int code = run_python(sp, args, out, sizeof(out));
    char *nl = strchr(out, '\n');
    if (nl)
        *nl = '\0';
    if (code != 0)
        slurm_error("stasis: %s", out[0] ? out : "stasis.slurm.jobnetnode failed to run");
    else if (out[0])
        slurm_info("%s", out);
    return ESPANK_SUCCESS;
}

int slurm_spank_job_prolog(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    return jobnet_script(sp, "prolog");
}

/* Whether a slurmstepd whose title starts with `want` (`len` bytes) runs in mount namespace
 * `mnt` (this node's: the local cluster runs several nodes' daemons on one machine), as root
 * (a user's process titled so must not hold the epilog). */
static int step_alive(const char *want, size_t len, ino_t mnt)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    int found = 0;

    if (!d)
        return 0;
    while (!found && (e = readdir(d))) {
        char path[300], buf[128];
        struct stat st;
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof(path), "/proc/%s/cmdline", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, buf, sizeof(buf));
        close(fd);
        if (n < (ssize_t)len || memcmp(buf, want, len))
            continue;
        snprintf(path, sizeof(path), "/proc/%s", e->d_name);
        if (stat(path, &st) != 0 || st.st_uid != 0)
            continue;
        snprintf(path, sizeof(path), "/proc/%s/ns/mnt", e->d_name);
        if (stat(path, &st) == 0 && st.st_ino == mnt)
            found = 1;
    }
    closedir(d);
    return found;
}

/* Slurm 22.05's job_container/tmpfs removes a job's container (its /tmp under BasePath/<job id>)
 * in the extern step's slurmstepd after that step told slurmd it ended: while the epilog runs.
 * A job requeued to this node again (stasis restores on requeue; the same job id) and launched
 * before that removal is done finds its container half gone ("container_p_join: open failed",
 * "_create_ns: ns base mount failed: Invalid argument") and is held, launch failed. Seen on
 * loaded machines. The epilog, which keeps the node's part of the job until it returns, waits for
 * that step to be gone (EXTERN_WAIT_S at most; nothing to wait for where no such step runs). */
static void wait_extern_step_gone(uint32_t id)
{
    char want[64];
    struct stat st;
    int len = snprintf(want, sizeof(want), "slurmstepd: [%u.extern]", id);

    if (!id || stat("/proc/self/ns/mnt", &st) != 0)
        return;
    for (int i = 0; i < EXTERN_WAIT_S * 10 && step_alive(want, (size_t)len, st.st_ino); i++)
        usleep(100000);
}

int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    wait_extern_step_gone(job_id(sp));
    return jobnet_script(sp, "epilog");
}

/* Every task of a job whose network the prolog made on this node enters it: decided by the
 * prolog's record (made only for opted-in jobs), not by the step's environment, which a step
 * may replace (srun --export=NONE). -1: the network is recorded but cannot be entered (the
 * task must not run beside its peers' network). */
static int enter_jobnet(spank_t sp)
{
    char path[128];

    if (!spank_remote(sp))
        return 0;
    snprintf(path, sizeof(path), JOBNET_RECORDS "/%u", job_id(sp));
    FILE *f = fopen(path, "re");
    if (!f)
        return 0; /* a one-node job, or none made here: the node's network */
    unsigned long vni = 0;
    int got = fscanf(f, "%lu", &vni);
    fclose(f);
    if (got != 1 || !vni) {
        slurm_error("stasis: %s does not hold a VXLAN id", path);
        return -1;
    }
    snprintf(path, sizeof(path), "/run/netns/stasis-job-%lu", vni);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) {
        slurm_error("stasis: cannot enter the job's network %s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    parse_args(ac, av);
    return ESPANK_SUCCESS;
}

static int batch_init(spank_t sp);

/* The job's own pseudo-terminals, in the mount namespace just unshared: a devpts instance of
 * its own on /dev/pts, whose numbers a restore finds free whatever else holds the node's
 * (stasis/engine/privatepts.py says why, and holds the same constants). Without it the job
 * still runs protected; only a restore of its terminals may find their numbers taken. */
static void private_pts(void)
{
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0 ||
        mount(PTS_SOURCE, "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, PTS_OPTIONS) < 0)
        slurm_error("stasis: no devpts of the job's own (%s): a restore of its pseudo-terminals "
                    "needs their numbers free on the node", strerror(errno));
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
    int rc = batch_init(sp);
    if (enter_jobnet(sp) < 0)
        return ESPANK_ERROR;
    return rc;
}

static int batch_init(spank_t sp)
{
    static char out[HELPER_OUTPUT_MAX];

    started = 0;
    if (!opted_in(sp))
        return ESPANK_SUCCESS;
    if (!python[0] || !launcher[0]) {
        set_off(sp, "stasis is not configured on this node (plugstack.conf needs python= and "
                    "launcher=)");
        return ESPANK_SUCCESS;
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        set_off(sp, "prctl(PR_SET_CHILD_SUBREAPER) failed");
        return ESPANK_SUCCESS;
    }
    int code = run_helper(sp, out, sizeof(out));
    if (code == EXIT_RESTORED) {
        started = 1;
    } else if (code == EXIT_FRESH) {
        /* An IPC namespace too: the job's SysV shared memory must be its own for CRIU. A mount
         * namespace for its own pseudo-terminals (private_pts). */
        if (unshare(CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS) < 0) {
            set_off(sp, "unshare(CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS) failed");
            return ESPANK_SUCCESS;
        }
        private_pts();
        started = 1;
    } else if (code == EXIT_OFF) {
        started = 0;
    } else {
        set_off(sp, "the stasis helper (stasis.slurm.taskinit) failed to run");
        return ESPANK_SUCCESS;
    }
    spank_setenv(sp, "STASIS_SLURM_START", out, 1);
    return ESPANK_SUCCESS;
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    int argc = 0;
    char **argv = NULL;
    char buf[8];

    if (!opted_in(sp) || !launcher[0])
        return ESPANK_SUCCESS;
    /* Also in the "off" case the launcher runs: it says why, and keeps the warning signal (USR1 of
     * jobs submitted before URG was asked for) from killing
     * the batch script (cli_filter asked Slurm to send it). */
    if (spank_getenv(sp, "STASIS_SLURM_START", buf, sizeof(buf)) == ESPANK_ENV_NOEXIST &&
        !started)
        return ESPANK_SUCCESS;
    if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS || argc < 1 || !argv)
        return ESPANK_SUCCESS;
    spank_setenv(sp, "STASIS_SLURM_SCRIPT", argv[0], 1);
    argv[0] = strdup(launcher);
    return ESPANK_SUCCESS;
}
