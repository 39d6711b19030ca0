/* holdfd: holds what CRIU cannot checkpoint, and keeps ticking, for the refusal tests (issue 31).
 *
 *   holdfd io_uring    creates an io_uring (io_uring_setup) and keeps its fd open
 *   holdfd PATH        opens PATH (an RDMA device such as /dev/infiniband/uverbs0, or a stand-in
 *                      at such a path) and keeps it open
 *
 * Prints "holding fd N" once it holds it, then "tick N" every 100 ms (so a test sees it keeps
 * running). The raw system call, not liburing: nothing to install beyond the kernel's headers.
 */
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: holdfd io_uring|PATH\n");
        return 2;
    }
    int fd;
    if (strcmp(argv[1], "io_uring") == 0) {
        struct io_uring_params params;
        memset(&params, 0, sizeof params);
        fd = (int)syscall(__NR_io_uring_setup, 8, &params);
    } else {
        fd = open(argv[1], O_RDWR);
    }
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    printf("holding fd %d\n", fd);
    fflush(stdout);
    for (long n = 0;; n++) {
        struct timespec ts = {0, 100000000L};
        nanosleep(&ts, NULL);
        printf("tick %ld\n", n);
        fflush(stdout);
    }
}
