/*
 * stasis-init: the init of a job's PID namespace.
 *
 *     stasis-init -- COMMAND [ARG]...
 *
 * Runs COMMAND as its child and stays until no process of the namespace is left, not just until
 * COMMAND exits: a program that daemonizes (forks, and its first process exits 0) is still the
 * job, and a namespace whose init exits is killed by the kernel. tini ends with its child, so it
 * cannot be this init.
 *
 * Every catchable signal the init gets is forwarded to every process of the namespace
 * (kill(-1, sig) from a namespace's init reaches all of them but itself): `stasis kill --signal
 * TERM` asks the whole job, daemonized servers included, to stop. Orphans are reaped. The exit
 * status is COMMAND's (128+N when signal N ended it), taken when the last process is gone.
 *
 * It blocks every signal and waits in sigwaitinfo(); a restore interrupts that wait (EINTR), which
 * is simply waited again. Static, small, no allocation: it is part of every checkpoint.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int status_code(int status)
{
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return WEXITSTATUS(status);
}

int main(int argc, char **argv)
{
	sigset_t all, old;
	pid_t child;
	int status = 0;

	if (argc < 3 || strcmp(argv[1], "--") != 0) {
		fprintf(stderr, "usage: stasis-init -- COMMAND [ARG]...\n");
		return 2;
	}
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, &old);

	child = fork();
	if (child < 0) {
		fprintf(stderr, "stasis-init: fork: %s\n", strerror(errno));
		return 127;
	}
	if (child == 0) {
		sigprocmask(SIG_SETMASK, &old, NULL);
		execvp(argv[2], argv + 2);
		fprintf(stderr, "stasis-init: cannot run %s: %s\n", argv[2], strerror(errno));
		_exit(127);
	}

	for (;;) {
		siginfo_t info;
		int sig, st;
		pid_t got;

		while ((got = waitpid(-1, &st, WNOHANG)) > 0)
			if (got == child)
				status = st;
		if (got < 0 && errno == ECHILD)
			break; /* nobody left: the job is over */

		sig = sigwaitinfo(&all, &info);
		if (sig < 0 || sig == SIGCHLD)
			continue;
		kill(-1, sig);
	}
	return status_code(status);
}
