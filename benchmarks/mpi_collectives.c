/* Open MPI's collectives timed exactly as benchmarks/compare_gloo.py times Gloo and netdist.
 *
 * Built and run by compare_gloo.py --mpi (mpicc, then mpirun on this host, so Open MPI
 * picks its shared-memory transport between the ranks). Per op and size: a barrier, then
 * one call, per iteration; an iteration's time is the slowest rank's; rank 0 prints one
 * JSON object per line: {"op": ..., "size": bytes, "median_s": ...}.
 *
 * usage: mpi_collectives ITERS WARMUP OP SIZE [OP SIZE ...]
 *   OP is all_reduce | reduce_scatter | all_gather | broadcast; SIZE in bytes of float32.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run_op(const char *op, int count, float *send, float *recv, int rank, int size) {
    int chunk = count / size;
    if (strcmp(op, "all_reduce") == 0) {
        MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else if (strcmp(op, "reduce_scatter") == 0) {
        MPI_Reduce_scatter_block(send, recv, chunk, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else if (strcmp(op, "all_gather") == 0) {
        MPI_Allgather(send + (size_t)rank * chunk, chunk, MPI_FLOAT, recv, chunk, MPI_FLOAT,
                      MPI_COMM_WORLD);
    } else if (strcmp(op, "broadcast") == 0) {
        MPI_Bcast(send, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 5 || (argc - 3) % 2 != 0) {
        if (rank == 0) fprintf(stderr, "usage: %s ITERS WARMUP OP SIZE [OP SIZE ...]\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int iters = atoi(argv[1]), warmup = atoi(argv[2]);
    double *times = malloc(sizeof(double) * (size_t)iters);
    for (int a = 3; a + 1 < argc; a += 2) {
        const char *op = argv[a];
        long bytes = atol(argv[a + 1]);
        int count = (int)(bytes / 4);
        count -= count % size;  /* equal chunks, as the other backends are given */
        float *send = malloc(sizeof(float) * (size_t)(count ? count : 1));
        float *recv = malloc(sizeof(float) * (size_t)(count ? count : 1));
        for (int i = 0; i < count; i++) send[i] = (float)(rank + 1);
        for (int i = 0; i < warmup + iters; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double started = MPI_Wtime();
            run_op(op, count, send, recv, rank, size);
            double elapsed = MPI_Wtime() - started, slowest;
            MPI_Reduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            if (i >= warmup) times[i - warmup] = slowest;
        }
        if (rank == 0) {
            qsort(times, (size_t)iters, sizeof(double), compare_doubles);
            double median = iters % 2 ? times[iters / 2]
                                      : (times[iters / 2 - 1] + times[iters / 2]) / 2;
            printf("{\"op\": \"%s\", \"size\": %ld, \"median_s\": %.9f}\n", op, 4L * count, median);
            fflush(stdout);
        }
        free(send);
        free(recv);
    }
    free(times);
    MPI_Finalize();
    return 0;
}
