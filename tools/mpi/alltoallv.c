/* MPI_Alltoallv baseline for `railwave bench`: moves the same rank-to-rank byte matrix as a
 * RailWave dispatch (and, with a second matrix, as its combine), with Open MPI over every rail
 * interface of the test bed.
 *   mpirun ... rw_mpi_alltoallv MATRIX_FILE REPEATS [RETURN_MATRIX_FILE]
 * A matrix file: first token W (ranks), then W*W byte counts, row = sender. Each repeat is one
 * MPI_Alltoallv of MATRIX_FILE timed between barriers, then (with RETURN_MATRIX_FILE) one of
 * that matrix, timed the same way; rank 0 prints one JSON line with every repeat's seconds
 * ("seconds", "return_seconds"). Data is a pattern that the receiver verifies, so a wrong
 * transfer fails the run instead of timing it. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int src, int dst, size_t i)
{
	return (unsigned char)((size_t)src * 131u + (size_t)dst * 31u + i * 7u);
}

/* One rank's side of an all-to-all: counts and displacements, a filled send buffer and a
 * receive buffer. */
typedef struct xfer {
	int *scount, *sdispl, *rcount, *rdispl;
	long long stotal, rtotal;
	unsigned char *sbuf, *rbuf;
} xfer_t;

static long long *read_matrix(const char *path, int rank, int world)
{
	FILE *f = fopen(path, "r");
	long w = 0;
	if (!f || fscanf(f, "%ld", &w) != 1 || w != world) {
		fprintf(stderr, "rank %d: %s: cannot read a %d-rank matrix\n", rank, path, world);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long long *m = calloc((size_t)world * (size_t)world, sizeof(*m));
	for (long i = 0; i < w * w; i++)
		if (fscanf(f, "%lld", &m[i]) != 1 || m[i] < 0 || m[i] > INT32_MAX) {
			fprintf(stderr, "rank %d: %s: bad matrix entry %ld\n", rank, path, i);
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
	fclose(f);
	return m;
}

static void xfer_init(xfer_t *x, const long long *m, int rank, int world)
{
	x->scount = calloc((size_t)world, sizeof(int));
	x->sdispl = calloc((size_t)world, sizeof(int));
	x->rcount = calloc((size_t)world, sizeof(int));
	x->rdispl = calloc((size_t)world, sizeof(int));
	x->stotal = x->rtotal = 0;
	for (int p = 0; p < world; p++) {
		x->scount[p] = (int)m[(size_t)rank * world + p];
		x->rcount[p] = (int)m[(size_t)p * world + rank];
		x->sdispl[p] = (int)x->stotal;
		x->rdispl[p] = (int)x->rtotal;
		x->stotal += x->scount[p];
		x->rtotal += x->rcount[p];
	}
	if (x->stotal > INT32_MAX || x->rtotal > INT32_MAX) {
		fprintf(stderr, "rank %d: per-rank volume over 2 GiB is not supported\n", rank);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	x->sbuf = malloc((size_t)x->stotal + 1);
	x->rbuf = malloc((size_t)x->rtotal + 1);
	for (int p = 0; p < world; p++)
		for (int i = 0; i < x->scount[p]; i++)
			x->sbuf[x->sdispl[p] + i] = pattern(rank, p, (size_t)i);
}

/* One timed all-to-all; returns its seconds and counts wrong bytes into *bad. */
static double xfer_run(xfer_t *x, int rank, int world, int *bad)
{
	memset(x->rbuf, 0, (size_t)x->rtotal);
	MPI_Barrier(MPI_COMM_WORLD);
	double t0 = MPI_Wtime();
	MPI_Alltoallv(x->sbuf, x->scount, x->sdispl, MPI_BYTE, x->rbuf, x->rcount, x->rdispl,
		      MPI_BYTE, MPI_COMM_WORLD);
	MPI_Barrier(MPI_COMM_WORLD);
	double secs = MPI_Wtime() - t0;
	for (int p = 0; p < world; p++)
		for (int i = 0; i < x->rcount[p]; i++)
			if (x->rbuf[x->rdispl[p] + i] != pattern(p, rank, (size_t)i))
				(*bad)++;
	return secs;
}

static void xfer_free(xfer_t *x)
{
	free(x->scount); free(x->sdispl); free(x->rcount); free(x->rdispl);
	free(x->sbuf); free(x->rbuf);
}

static void print_secs(const char *name, const double *secs, int n)
{
	printf(", \"%s\": [", name);
	for (int it = 0; it < n; it++)
		printf("%s%.6f", it ? ", " : "", secs[it]);
	printf("]");
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
	long long *m = read_matrix(argv[1], rank, world);
	long long *mr = argc > 3 ? read_matrix(argv[3], rank, world) : NULL;
	xfer_t fwd, ret;
	xfer_init(&fwd, m, rank, world);
	if (mr)
		xfer_init(&ret, mr, rank, world);
	double *secs = calloc((size_t)(repeats > 0 ? repeats : 1), sizeof(double));
	double *rsecs = calloc((size_t)(repeats > 0 ? repeats : 1), sizeof(double));
	int bad = 0;
	for (int it = 0; it < repeats; it++) {
		secs[it] = xfer_run(&fwd, rank, world, &bad);
		if (mr)
			rsecs[it] = xfer_run(&ret, rank, world, &bad);
	}
	int bad_all = 0;
	MPI_Reduce(&bad, &bad_all, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		long long total = 0;
		for (long i = 0; i < (long)world * world; i++)
			total += (i / world != i % world) ? m[i] : 0;
		printf("{\"ranks\": %d, \"bytes\": %lld, \"errors\": %d", world, total, bad_all);
		print_secs("seconds", secs, repeats);
		if (mr)
			print_secs("return_seconds", rsecs, repeats);
		printf("}\n");
	}
	free(secs);
	free(rsecs);
	free(m);
	free(mr);
	xfer_free(&fwd);
	if (mr)
		xfer_free(&ret);
	MPI_Finalize();
	return bad_all ? 1 : 0;
}
