/* MPI_Alltoallv baseline for `railwave bench`: moves the same rank-to-rank byte matrix as a
 * RailWave dispatch, with Open MPI over every rail interface of the test bed.
 *   mpirun ... rw_mpi_alltoallv MATRIX_FILE REPEATS
 * MATRIX_FILE: first token W (ranks), then W*W byte counts, row = sender. Each repeat is timed
 * between barriers; rank 0 prints one JSON line with every repeat's seconds. Data is a pattern
 * that the receiver verifies, so a wrong transfer fails the run instead of timing it. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int src, int dst, size_t i)
{
	return (unsigned char)((size_t)src * 131u + (size_t)dst * 31u + i * 7u);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, world;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &world);
	if (argc < 3) {
		if (rank == 0)
			fprintf(stderr, "usage: %s MATRIX_FILE REPEATS\n", argv[0]);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	int repeats = atoi(argv[2]);
	FILE *f = fopen(argv[1], "r");
	long w = 0;
	if (!f || fscanf(f, "%ld", &w) != 1 || w != world) {
		fprintf(stderr, "rank %d: %s: cannot read a %d-rank matrix\n", rank, argv[1], world);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long long *m = calloc((size_t)world * (size_t)world, sizeof(*m));
	for (long i = 0; i < w * w; i++)
		if (fscanf(f, "%lld", &m[i]) != 1 || m[i] < 0 || m[i] > INT32_MAX) {
			fprintf(stderr, "rank %d: bad matrix entry %ld\n", rank, i);
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
	fclose(f);
	int *scount = calloc((size_t)world, sizeof(int)), *sdispl = calloc((size_t)world, sizeof(int));
	int *rcount = calloc((size_t)world, sizeof(int)), *rdispl = calloc((size_t)world, sizeof(int));
	long long stotal = 0, rtotal = 0;
	for (int p = 0; p < world; p++) {
		scount[p] = (int)m[(size_t)rank * world + p];
		rcount[p] = (int)m[(size_t)p * world + rank];
		sdispl[p] = (int)stotal;
		rdispl[p] = (int)rtotal;
		stotal += scount[p];
		rtotal += rcount[p];
	}
	if (stotal > INT32_MAX || rtotal > INT32_MAX) {
		fprintf(stderr, "rank %d: per-rank volume over 2 GiB is not supported\n", rank);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	unsigned char *sbuf = malloc((size_t)stotal + 1), *rbuf = malloc((size_t)rtotal + 1);
	for (int p = 0; p < world; p++)
		for (int i = 0; i < scount[p]; i++)
			sbuf[sdispl[p] + i] = pattern(rank, p, (size_t)i);
	double *secs = calloc((size_t)(repeats > 0 ? repeats : 1), sizeof(double));
	int bad = 0;
	for (int it = 0; it < repeats; it++) {
		memset(rbuf, 0, (size_t)rtotal);
		MPI_Barrier(MPI_COMM_WORLD);
		double t0 = MPI_Wtime();
		MPI_Alltoallv(sbuf, scount, sdispl, MPI_BYTE, rbuf, rcount, rdispl, MPI_BYTE,
			      MPI_COMM_WORLD);
		MPI_Barrier(MPI_COMM_WORLD);
		secs[it] = MPI_Wtime() - t0;
		for (int p = 0; p < world; p++)
			for (int i = 0; i < rcount[p]; i++)
				if (rbuf[rdispl[p] + i] != pattern(p, rank, (size_t)i))
					bad++;
	}
	int bad_all = 0;
	MPI_Reduce(&bad, &bad_all, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		long long total = 0;
		for (long i = 0; i < w * w; i++)
			total += (i / w != i % w) ? m[i] : 0;
		printf("{\"ranks\": %d, \"bytes\": %lld, \"errors\": %d, \"seconds\": [", world, total, bad_all);
		for (int it = 0; it < repeats; it++)
			printf("%s%.6f", it ? ", " : "", secs[it]);
		printf("]}\n");
	}
	free(secs); free(sbuf); free(rbuf); free(m);
	free(scount); free(sdispl); free(rcount); free(rdispl);
	MPI_Finalize();
	return bad_all ? 1 : 0;
}
