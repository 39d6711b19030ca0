/* mpi_stencil: the reference MPI program of the multi-node job tests (issue 31).
 *
 *   mpi_stencil ITERATIONS SLEEP_MS [POINTS]
 *
 * A 1-D heat-like stencil over POINTS points (default 4096) split into contiguous blocks, one per
 * rank. Every iteration each rank exchanges one halo point with each neighbour (MPI_Sendrecv),
 * updates its block, then the job reduces a checksum (MPI_Allreduce, integer sum) and a maximum
 * (MPI_Allreduce, MPI_MAX); rank 0 prints one line per iteration:
 *
 *   iter 17 checksum 0123456789abcdef max 0.96875
 *
 * and sleeps SLEEP_MS between iterations (every rank), so that a test can stop it mid-run.
 * The output depends on ITERATIONS and POINTS only: not on the number of ranks, their nodes, the
 * MPI or its transport. Each point's update is the same floating-point operations whatever the
 * split, and the checksum sums the points' bit patterns as unsigned 64-bit integers, whose sum
 * does not depend on the order the reduction takes (a floating-point sum would).
 * The first line names the ranks' hosts, in rank order: "ranks 4 hosts n1,n1,n2,n2".
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define HOST_LEN 64

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
        /* EINTR (a signal, or a restore that cannot restart the call): sleep the rest */
    }
}

static double initial(long i)
{
    return (double)((i * 2654435761L) % 1000) / 1000.0;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 3) {
        if (rank == 0)
            fprintf(stderr, "usage: mpi_stencil ITERATIONS SLEEP_MS [POINTS]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long iterations = atol(argv[1]);
    long pause_ms = atol(argv[2]);
    long points = argc > 3 ? atol(argv[3]) : 4096;
    if (iterations < 0 || pause_ms < 0 || points < size) {
        if (rank == 0)
            fprintf(stderr, "mpi_stencil: need ITERATIONS >= 0, SLEEP_MS >= 0, POINTS >= ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    char host[HOST_LEN] = {0};
    gethostname(host, HOST_LEN - 1);
    char *hosts = rank == 0 ? calloc((size_t)size, HOST_LEN) : NULL;
    MPI_Gather(host, HOST_LEN, MPI_CHAR, hosts, HOST_LEN, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("ranks %d hosts ", size);
        for (int r = 0; r < size; r++)
            printf("%s%s", r ? "," : "", hosts + (size_t)r * HOST_LEN);
        printf("\n");
        fflush(stdout);
        free(hosts);
    }

    /* This rank's block [first, first + n); u[0] and u[n + 1] are the halo. */
    long first = points * rank / size;
    long n = points * (rank + 1) / size - first;
    double *u = calloc((size_t)n + 2, sizeof(double));
    double *next = calloc((size_t)n + 2, sizeof(double));
    for (long i = 0; i < n; i++)
        u[i + 1] = initial(first + i);
    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;

    for (long it = 1; it <= iterations; it++) {
        /* Fixed boundaries: the halo beyond the ends stays 0 (MPI_PROC_NULL leaves it as is). */
        MPI_Sendrecv(&u[1], 1, MPI_DOUBLE, left, 0, &u[n + 1], 1, MPI_DOUBLE, right, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(&u[n], 1, MPI_DOUBLE, right, 1, &u[0], 1, MPI_DOUBLE, left, 1,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        uint64_t local_sum = 0;
        double local_max = 0.0;
        for (long i = 1; i <= n; i++) {
            long g = first + i - 1;
            next[i] = 0.25 * u[i - 1] + 0.5 * u[i] + 0.25 * u[i + 1] + 0.001 * (double)((g + it) % 7);
            uint64_t bits;
            memcpy(&bits, &next[i], sizeof bits);
            local_sum += bits;
            if (next[i] > local_max)
                local_max = next[i];
        }
        double *t = u;
        u = next;
        next = t;
        uint64_t sum = 0;
        double max = 0.0;
        MPI_Allreduce(&local_sum, &sum, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(&local_max, &max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("iter %ld checksum %016llx max %.17g\n", it, (unsigned long long)sum, max);
            fflush(stdout);
        }
        if (pause_ms)
            sleep_ms(pause_ms);
    }
    free(u);
    free(next);
    MPI_Finalize();
    return 0;
}
