/* The fluid simulator of `railwave sim` (tools/sim.h): hand-computable cases for both fabric
 * models (one flow, incast, a max-min example with two levels, permutation waves, congestion
 * spreading under PFC, pause efficiency), properties over random flows (bytes conserved, no
 * port above capacity, nothing faster than its NIC allows), the four paths on synthetic
 * routing (lower bound, combine, determinism, thread count), and the subcommand itself,
 * including the replay of a test-bed result. Run from the repository root (as tests/run does). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "test_rng.h"
#include "tools/sim.h"
#include "tools/synth.h"
#include "tools/tools.h"
#include "tests/unit/test_capture.h"

#define GBPS(x) ((x) * 1e9 / 8)

static rw_sim_fabric_t fabric(uint32_t nodes, uint32_t rails, double Bps)
{
	rw_sim_fabric_t f = { .nodes = nodes, .rails = rails };
	for (uint32_t r = 0; r < rails; r++)
		f.rail_Bps[r] = Bps;
	return f;
}

static rw_sim_opts_t exact(rw_sim_model_t model)
{
	rw_sim_opts_t o;
	rw_sim_opts_default(&o);
	o.model = model;
	o.batch_eps = 0;
	o.verify = 1;
	return o;
}

static void assert_close(double got, double want, double rel)
{
	if (!(fabs(got - want) <= rel * fabs(want) + 1e-15))
		fail_msg("got %.12g, want %.12g (relative tolerance %g)", got, want, rel);
}

static double sum_bytes(const rw_sim_flow_t *fl, size_t n)
{
	double b = 0;
	for (size_t i = 0; i < n; i++)
		b += fl[i].bytes;
	return b;
}

/* Run both models; the result of model m in res[m], finish times in fin[m] (n entries). */
static void run_both(const rw_sim_fabric_t *fab, const rw_sim_flow_t *fl, size_t n,
		     rw_sim_result_t res[2], double *fin[2])
{
	for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
		rw_sim_opts_t o = exact((rw_sim_model_t)m);
		assert_int_equal(rw_sim_run(fab, &o, fl, n, fin ? fin[m] : NULL, &res[m]), RW_OK);
		assert_int_equal(res[m].violations, 0);
		assert_close(res[m].bytes, sum_bytes(fl, n), 1e-9);
	}
}

static void test_single_flow(void **state)
{
	(void)state;
	rw_sim_fabric_t fab = fabric(2, 1, GBPS(400));
	rw_sim_flow_t fl = { .src = 0, .dst = 1, .rail = 0, .bytes = 1e8 };
	rw_sim_result_t res[2];
	double f0, f1, *fin[2] = { &f0, &f1 };
	run_both(&fab, &fl, 1, res, fin);
	for (int m = 0; m < 2; m++) {
		assert_close(res[m].time, 1e8 / GBPS(400), 1e-12); /* bytes / C */
		assert_close(*fin[m], res[m].time, 1e-12);
		assert_int_equal(res[m].max_fan_in, 1);
	}
}

/* The receiver gate (opts.wave_gate, the daemon's GRANT): node 0's wave-1 source is 3 and its
 * wave-2 source is 2; node 2 has nothing for wave 1, so without the gate it writes its wave-2
 * flow at once, alongside 3's (fan-in 2); with the gate node 0 admits 2 only when 3's flow is
 * in (fan-in 1), and 2's flow runs alone afterwards. */
static void test_wave_gate(void **state)
{
	(void)state;
	rw_sim_fabric_t fab = fabric(4, 1, 1e9);
	rw_sim_flow_t fl[3] = { { .src = 3, .dst = 0, .wave = 1, .bytes = 1e9 },
				{ .src = 2, .dst = 0, .wave = 2, .bytes = 1e8 },
				{ .src = 1, .dst = 2, .wave = 1, .bytes = 1e8 } };
	double fin[3];
	rw_sim_result_t res;
	rw_sim_opts_t o = exact(RW_SIM_MAXMIN);
	assert_int_equal(o.wave_gate, 1); /* the default */
	assert_int_equal(rw_sim_run(&fab, &o, fl, 3, fin, &res), RW_OK);
	assert_int_equal(res.max_fan_in, 1);
	assert_close(fin[0], 1.0, 1e-12);
	assert_close(fin[1], 1.1, 1e-12);
	assert_close(fin[2], 0.1, 1e-12); /* nothing into 2 before wave 1: never waits */
	o.wave_gate = 0;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 3, fin, &res), RW_OK);
	assert_int_equal(res.max_fan_in, 2);
	assert_close(fin[1], 0.2, 1e-12); /* half of node 0's port while both send */
	assert_close(fin[0], 1.1, 1e-12);

	/* A whole phase through the path builder: Joint at N = 12 on skewed counts never feeds a
	 * receiver from two waves at once under the gate, and moves the same bytes. */
	const uint32_t N = 12, R = 2;
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, N, R, R), RW_OK);
	uint32_t counts[12 * 12 * 2];
	uint64_t x = 88172645463325252ull;
	for (size_t i = 0; i < (size_t)N * N * R; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		counts[i] = (uint32_t)(x % 97) * (uint32_t)(x % 5 == 0 ? 20 : 1);
	}
	rw_sim_fabric_t eq = fabric(N, R, 1e9);
	rw_sim_report_t gated, free_run;
	for (int combine = 0; combine < 2; combine++) {
		o = exact(RW_SIM_LOSSLESS);
		assert_int_equal(rw_sim_path(&topo, &eq, &o, RW_PATH_JOINT, counts, 1000, combine, &gated), RW_OK);
		assert_int_equal(gated.run.max_fan_in, 1);
		assert_int_equal(gated.run.violations, 0);
		o.wave_gate = 0;
		assert_int_equal(rw_sim_path(&topo, &eq, &o, RW_PATH_JOINT, counts, 1000, combine, &free_run), RW_OK);
		assert_true(free_run.run.max_fan_in > 1);
		assert_close(gated.run.bytes, free_run.run.bytes, 1e-12);
		assert_true(gated.run.time >= gated.lower_bound * (1 - 1e-9));
	}
}

static void test_incast_two(void **state)
{
	(void)state;
	/* Two senders into one ingress port: each gets C/2, so the pair takes twice one flow.
	 * Lossless adds the head-of-line loss of two senders contending: h(2) = 0.75 of C. */
	rw_sim_fabric_t fab = fabric(3, 1, 1e9);
	rw_sim_flow_t fl[2] = { { .src = 1, .dst = 0, .bytes = 5e8 }, { .src = 2, .dst = 0, .bytes = 5e8 } };
	rw_sim_result_t res[2];
	double a[2], b[2], *fin[2] = { a, b };
	run_both(&fab, fl, 2, res, fin);
	const double want[2] = { [RW_SIM_MAXMIN] = 1.0, [RW_SIM_LOSSLESS] = 1.0 / 0.75 };
	for (int m = 0; m < 2; m++) {
		assert_close(res[m].time, want[m], 1e-12);
		assert_close(fin[m][0], want[m], 1e-12);
		assert_close(fin[m][1], want[m], 1e-12);
		assert_int_equal(res[m].max_fan_in, 2);
	}
}

static void test_maxmin_classic(void **state)
{
	(void)state;
	/* A -> X, A -> Y, B -> Y, C -> Y with every port at 1 (unit: 1e9 B/s). Ingress Y fills
	 * first at 1/3 for its three flows; A -> X then takes what A has left: 2/3. Sizes chosen so
	 * that every flow ends at t = 1 under those rates, except A -> X, which has 1/3 more and
	 * then runs alone at the full rate of A: it ends at 4/3. Under lossless the same (egress A
	 * is not congested: ingress Y's senders are locked at 1/3, A -> X shares A's lock). */
	enum { A = 0, B = 1, C = 2, X = 3, Y = 4 };
	rw_sim_fabric_t fab = fabric(5, 1, 1e9);
	rw_sim_flow_t fl[4] = {
		{ .src = A, .dst = X, .bytes = 1e9 },
		{ .src = A, .dst = Y, .bytes = 1e9 / 3 },
		{ .src = B, .dst = Y, .bytes = 1e9 / 3 },
		{ .src = C, .dst = Y, .bytes = 1e9 / 3 },
	};
	rw_sim_opts_t o = exact(RW_SIM_MAXMIN);
	rw_sim_result_t res;
	double fin[4];
	assert_int_equal(rw_sim_run(&fab, &o, fl, 4, fin, &res), RW_OK);
	assert_int_equal(res.violations, 0);
	for (int i = 1; i < 4; i++)
		assert_close(fin[i], 1.0, 1e-12);
	assert_close(fin[0], 4.0 / 3, 1e-12); /* 2/3 by t = 1, the last 1/3 at rate 1 */
	assert_close(res.time, 4.0 / 3, 1e-12);
	assert_int_equal(res.events, 2);
	/* Lossless, fluid part only (hol 0): A's two flows are locked at Y's share 1/3, so A -> X
	 * has moved only 1/3 by t = 1 and needs 2/3 more at the full rate. */
	o = exact(RW_SIM_LOSSLESS);
	o.hol = 0;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 4, fin, &res), RW_OK);
	for (int i = 1; i < 4; i++)
		assert_close(fin[i], 1.0, 1e-12);
	assert_close(fin[0], 5.0 / 3, 1e-12);
}

static void test_congestion_spreading(void **state)
{
	(void)state;
	/* Incast: nodes 1, 2, 3 send a lot to node 0. Node 1 also sends B bytes to node 4, whose
	 * ingress is free: the "unrelated" flow. Max-min: ingress 0 gives each sender 1/3 and the
	 * unrelated flow takes the other 2/3 of node 1's egress: B / (2C/3). Lossless: PFC paces
	 * node 1's NIC to its share at ingress 0 and the pause stalls the unrelated flow too:
	 * B / (C/3), twice as long (hol 0); with head-of-line contention at ingress 0 (three
	 * senders: h(3) = 0.6825) that share is 0.6825 C / 3. */
	rw_sim_fabric_t fab = fabric(5, 1, 1e9);
	const double B = 1e8;
	rw_sim_flow_t fl[4] = {
		{ .src = 1, .dst = 0, .bytes = 1e10 },
		{ .src = 2, .dst = 0, .bytes = 1e10 },
		{ .src = 3, .dst = 0, .bytes = 1e10 },
		{ .src = 1, .dst = 4, .bytes = B },
	};
	rw_sim_result_t res[2];
	double a[4], b[4], *fin[2] = { a, b };
	run_both(&fab, fl, 4, res, fin);
	assert_close(fin[RW_SIM_MAXMIN][3], B / (2e9 / 3), 1e-12);
	assert_close(fin[RW_SIM_LOSSLESS][3], B / (0.6825e9 / 3), 1e-12);
	/* The incast itself: ingress 0 drains 3e10 bytes at C, or at 0.6825 C when lossless. */
	assert_close(res[RW_SIM_MAXMIN].time, 3e10 / 1e9, 1e-9);
	assert_close(res[RW_SIM_LOSSLESS].time, 3e10 / 0.6825e9, 1e-9);
	rw_sim_opts_t o = exact(RW_SIM_LOSSLESS);
	o.hol = 0;
	rw_sim_result_t r;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 4, a, &r), RW_OK);
	assert_close(a[3], B / (1e9 / 3), 1e-12);
	assert_close(r.time, 3e10 / 1e9, 1e-9);

	/* No incast (one sender into node 0): no pause, so no spreading; the models agree. */
	rw_sim_flow_t calm[2] = { fl[0], fl[3] };
	run_both(&fab, calm, 2, res, fin);
	assert_close(fin[RW_SIM_LOSSLESS][1], fin[RW_SIM_MAXMIN][1], 1e-12);
	assert_close(fin[RW_SIM_LOSSLESS][1], B / 0.5e9, 1e-12);
}

static void test_hol_weight(void **state)
{
	(void)state;
	/* Three senders into one port: under the lossless model it delivers
	 * C (1 - hol (1 - h(3))); max-min ignores the parameter; a lone flow is never paced. */
	assert_close(rw_sim_hol_throughput(1), 1.0, 0);
	assert_close(rw_sim_hol_throughput(2), 0.75, 0);
	assert_close(rw_sim_hol_throughput(8), 0.6184, 0);
	assert_close(rw_sim_hol_throughput(9), 0.5858 + 0.0326 * 8 / 9, 1e-12);
	for (uint32_t k = 1; k < 100; k++) /* more contenders, less throughput, never below the limit */
		assert_true(rw_sim_hol_throughput(k + 1) < rw_sim_hol_throughput(k) &&
			    rw_sim_hol_throughput(k + 1) > 2 - sqrt(2));
	rw_sim_fabric_t fab = fabric(4, 1, 1e9);
	rw_sim_flow_t fl[3] = { { .src = 1, .dst = 0, .bytes = 1e9 }, { .src = 2, .dst = 0, .bytes = 1e9 },
				{ .src = 3, .dst = 0, .bytes = 1e9 } };
	rw_sim_opts_t o = exact(RW_SIM_LOSSLESS);
	rw_sim_result_t res;
	const double hol[3] = { 1.0, 0.5, 0.0 };
	for (int i = 0; i < 3; i++) {
		o.hol = hol[i];
		assert_int_equal(rw_sim_run(&fab, &o, fl, 3, NULL, &res), RW_OK);
		assert_close(res.time, 3.0 / (1 - hol[i] * (1 - 0.6825)), 1e-12);
	}
	o.model = RW_SIM_MAXMIN;
	o.hol = 1;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 3, NULL, &res), RW_OK);
	assert_close(res.time, 3.0, 1e-12);
	o.model = RW_SIM_LOSSLESS;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 1, NULL, &res), RW_OK);
	assert_close(res.time, 1.0, 1e-12);
	o.hol = 1.5;
	assert_int_equal(rw_sim_run(&fab, &o, fl, 1, NULL, &res), RW_ERR_INVAL);
}

static void test_waves_sum_of_maxima(void **state)
{
	(void)state;
	/* N = 5, R = 3 rails at different rates. In wave k every node sends to s + k on every rail
	 * with bytes b[k][r], the same for every source: every node finishes wave k at the same
	 * time, so the phase is the sum over waves of the slowest rail of that wave. */
	const uint32_t N = 5, R = 3;
	rw_sim_fabric_t fab = { .nodes = N, .rails = R, .rail_Bps = { 1e9, 2e9, 0.5e9 } };
	rw_sim_flow_t fl[5 * 4 * 3];
	size_t n = 0;
	double want = 0;
	for (uint32_t k = 1; k < N; k++) {
		double slowest = 0;
		for (uint32_t r = 0; r < R; r++) {
			double b = 1e8 * (1 + (k * 7 + r * 3) % 5);
			slowest = fmax(slowest, b / fab.rail_Bps[r]);
			for (uint32_t s = 0; s < N; s++)
				fl[n++] = (rw_sim_flow_t){ .src = s, .dst = rw_sched_wave_dst(N, s, k), .rail = r,
							   .wave = k, .bytes = b };
		}
		want += slowest;
	}
	rw_sim_result_t res[2];
	double a[60], b[60], *fin[2] = { a, b };
	run_both(&fab, fl, n, res, fin);
	for (int m = 0; m < 2; m++) {
		assert_close(res[m].time, want, 1e-12);
		assert_int_equal(res[m].max_fan_in, 1); /* a permutation per wave, in lock step */
	}

	/* The same through the path builder: Permutation-only on counts that depend only on the
	 * wave and the rail (records of 1000 bytes), at 1e9 B/s on every rail. */
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, N, R, R), RW_OK);
	uint32_t counts[5 * 5 * 3] = { 0 };
	want = 0;
	for (uint32_t k = 1; k < N; k++) {
		uint32_t most = 0;
		for (uint32_t r = 0; r < R; r++) {
			uint32_t c = 10 + (k * 5 + r * 11) % 17;
			most = c > most ? c : most;
			for (uint32_t s = 0; s < N; s++)
				counts[(s * N + rw_sched_wave_dst(N, s, k)) * R + r] = c;
		}
		want += most * 1000.0 / 1e9;
	}
	rw_sim_fabric_t eq = fabric(N, R, 1e9);
	rw_sim_opts_t o = exact(RW_SIM_LOSSLESS);
	rw_sim_report_t rep;
	assert_int_equal(rw_sim_path(&topo, &eq, &o, RW_PATH_PERM_ONLY, counts, 1000, 0, &rep), RW_OK);
	assert_close(rep.run.time, want, 1e-12);
	assert_int_equal(rep.run.max_fan_in, 1);
	assert_int_equal(rep.static_fan_in, N - 1);
	/* Joint balances each pair's rails first: the sum of per-wave balanced maxima. */
	double joint = 0;
	for (uint32_t k = 1; k < N; k++) {
		uint32_t t = 0;
		for (uint32_t r = 0; r < R; r++)
			t += counts[(0 * N + k) * R + r];
		joint += (t / R + (t % R != 0)) * 1000.0 / 1e9;
	}
	assert_int_equal(rw_sim_path(&topo, &eq, &o, RW_PATH_JOINT, counts, 1000, 0, &rep), RW_OK);
	assert_close(rep.run.time, joint, 1e-12);
}

/* Random flows: N nodes, R rails with random rates, random waves (or all wave 0). */
static size_t random_flows(uint32_t N, uint32_t R, int waves, rw_sim_fabric_t *fab, rw_sim_flow_t **out)
{
	*fab = (rw_sim_fabric_t){ .nodes = N, .rails = R };
	for (uint32_t r = 0; r < R; r++)
		fab->rail_Bps[r] = 1e9 * (1 + rng_below(4));
	size_t n = 1 + rng_below(4 * N * R);
	rw_sim_flow_t *fl = malloc(n * sizeof(*fl));
	assert_non_null(fl);
	for (size_t i = 0; i < n; i++) {
		uint32_t s = rng_below(N), d = (s + 1 + rng_below(N - 1)) % N;
		fl[i] = (rw_sim_flow_t){ .src = s, .dst = d, .rail = rng_below(R),
					 .wave = waves ? rng_below(4) : 0,
					 .bytes = 1e6 * (1 + rng_below(1000)) };
	}
	*out = fl;
	return n;
}

static void test_random_properties(void **state)
{
	(void)state;
	seed_rng("test_random_properties");
	for (int iter = 0; iter < 300; iter++) {
		uint32_t N = 2 + rng_below(9), R = 1 + rng_below(4);
		rw_sim_fabric_t fab;
		rw_sim_flow_t *fl;
		size_t n = random_flows(N, R, iter % 2, &fab, &fl);
		double *fin = malloc(n * sizeof(double));
		assert_non_null(fin);
		/* Work of the busiest port: nothing can finish before it. */
		double port[2 * 10 * 4] = { 0 }, floor_t = 0;
		for (size_t i = 0; i < n; i++) {
			port[fl[i].rail * N + fl[i].src] += fl[i].bytes / fab.rail_Bps[fl[i].rail];
			port[N * R + fl[i].rail * N + fl[i].dst] += fl[i].bytes / fab.rail_Bps[fl[i].rail];
		}
		for (uint32_t p = 0; p < 2 * N * R; p++)
			floor_t = fmax(floor_t, port[p]);
		for (int m = 0; m < RW_SIM_MODEL_COUNT; m++)
			for (int batched = 0; batched < 2; batched++) {
				rw_sim_opts_t o = exact((rw_sim_model_t)m);
				o.batch_eps = batched ? 0.01 : 0;
				o.hol = iter % 3 == 0 ? 0.5 : 1.0;
				o.threads = 1 + rng_below(3);
				rw_sim_result_t res;
				assert_int_equal(rw_sim_run(&fab, &o, fl, n, fin, &res), RW_OK);
				assert_int_equal(res.violations, 0);          /* no port above capacity */
				assert_close(res.bytes, sum_bytes(fl, n), 1e-9); /* bytes conserved */
				assert_true(res.time >= floor_t * (1 - 1e-9));
				double last = 0;
				for (size_t i = 0; i < n; i++) {
					assert_true(fin[i] >= fl[i].bytes / fab.rail_Bps[fl[i].rail] * (1 - 1e-9));
					last = fmax(last, fin[i]);
				}
				assert_true(last == res.time);
				assert_true(res.max_fan_in >= 1 && res.max_fan_in < N);
			}
		free(fin);
		free(fl);
	}
}

static void test_order_and_threads(void **state)
{
	(void)state;
	/* The result does not depend on the order the flows are listed in, nor on the threads. */
	seed_rng("test_order_and_threads");
	for (int iter = 0; iter < 50; iter++) {
		rw_sim_fabric_t fab;
		rw_sim_flow_t *fl;
		size_t n = random_flows(3 + rng_below(6), 1 + rng_below(4), iter % 2, &fab, &fl);
		double *f1 = malloc(n * sizeof(double)), *f2 = malloc(n * sizeof(double));
		size_t *perm = malloc(n * sizeof(size_t));
		rw_sim_flow_t *sh = malloc(n * sizeof(*sh));
		assert_true(f1 && f2 && perm && sh);
		for (size_t i = 0; i < n; i++)
			perm[i] = i;
		for (size_t i = n; i > 1; i--) {
			size_t j = rng_below((uint32_t)i), t = perm[i - 1];
			perm[i - 1] = perm[j];
			perm[j] = t;
		}
		for (size_t i = 0; i < n; i++)
			sh[i] = fl[perm[i]];
		rw_sim_opts_t o;
		rw_sim_opts_default(&o);
		o.model = (rw_sim_model_t)(iter % 2);
		rw_sim_result_t r1, r2;
		o.threads = 1;
		assert_int_equal(rw_sim_run(&fab, &o, fl, n, f1, &r1), RW_OK);
		o.threads = 4;
		assert_int_equal(rw_sim_run(&fab, &o, sh, n, f2, &r2), RW_OK);
		assert_true(r1.time == r2.time);
		assert_true(r1.max_fan_in == r2.max_fan_in);
		for (size_t i = 0; i < n; i++)
			assert_true(f2[i] == f1[perm[i]]);
		free(f1);
		free(f2);
		free(perm);
		free(sh);
		free(fl);
	}
}

static void test_bad_input(void **state)
{
	(void)state;
	rw_sim_fabric_t fab = fabric(3, 2, 1e9);
	rw_sim_opts_t o = exact(RW_SIM_MAXMIN);
	rw_sim_result_t res;
	rw_sim_flow_t ok = { .src = 0, .dst = 1, .rail = 1, .bytes = 10 };
	rw_sim_flow_t bad[] = {
		{ .src = 1, .dst = 1, .rail = 0, .bytes = 10 },   /* to itself */
		{ .src = 0, .dst = 3, .rail = 0, .bytes = 10 },   /* no such node */
		{ .src = 0, .dst = 1, .rail = 2, .bytes = 10 },   /* no such rail */
		{ .src = 0, .dst = 1, .rail = 0, .bytes = 0 },    /* empty */
		{ .src = 0, .dst = 1, .rail = 0, .bytes = NAN },
	};
	assert_int_equal(rw_sim_run(&fab, &o, &ok, 1, NULL, &res), RW_OK);
	for (size_t i = 0; i < RW_ARRAY_SIZE(bad); i++)
		assert_int_equal(rw_sim_run(&fab, &o, &bad[i], 1, NULL, &res), RW_ERR_INVAL);
	o.batch_eps = -1;
	assert_int_equal(rw_sim_run(&fab, &o, &ok, 1, NULL, &res), RW_ERR_INVAL);
	o = exact(RW_SIM_MAXMIN);
	fab.rail_Bps[1] = 0;
	assert_int_equal(rw_sim_run(&fab, &o, &ok, 1, NULL, &res), RW_ERR_INVAL);
	fab.rail_Bps[1] = 1e9;
	assert_int_equal(rw_sim_run(&fab, &o, NULL, 0, NULL, &res), RW_OK); /* nothing to send */
	assert_true(res.time == 0 && res.events == 0);
	rw_sim_model_t m;
	assert_int_equal(rw_sim_model_parse("maxmin", &m), RW_OK);
	assert_int_equal(m, RW_SIM_MAXMIN);
	assert_int_equal(rw_sim_model_parse("lossy", &m), RW_ERR_INVAL);
	assert_string_equal(rw_sim_model_name(RW_SIM_LOSSLESS), "lossless");
}

/* Synthetic routing counts for a small cluster. */
static uint32_t *synth_counts(rw_topo_t *topo, uint32_t N, uint32_t G, uint32_t R, uint64_t seed,
			      double rail_skew)
{
	assert_int_equal(rw_sched_topo_init(topo, N, G, R), RW_OK);
	rw_synth_cfg_t cfg = { .nodes = N, .gpus_per_node = G, .n_experts = 128, .topk = 8,
			       .tokens_per_rank = 256, .seed = seed, .zipf_s = 0.8, .dirichlet = 20,
			       .rail_skew = rail_skew };
	rw_synth_t gen;
	assert_int_equal(rw_synth_init(&gen, &cfg), RW_OK);
	int32_t *ids = malloc(sizeof(int32_t) * G * cfg.tokens_per_rank * cfg.topk);
	uint32_t *counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	assert_true(ids && counts);
	assert_int_equal(rw_synth_counts(&gen, topo, ids, counts), RW_OK);
	free(ids);
	rw_synth_free(&gen);
	return counts;
}

static void test_paths(void **state)
{
	(void)state;
	const uint32_t N = 8, G = 4, R = 4;
	const uint64_t rec = 8192;
	rw_topo_t topo;
	uint32_t *counts = synth_counts(&topo, N, G, R, 3, 0.7);
	rw_sim_fabric_t fab = fabric(N, R, GBPS(100));
	/* The lower bound is rw_sched_lower_bound's busiest NIC, in seconds at equal rates. */
	double lb = rw_sim_lower_bound(&topo, &fab, counts, rec);
	assert_close(lb, (double)rw_sched_lower_bound(&topo, counts) * rec / GBPS(100), 1e-12);
	double exact_time[RW_PATH_COUNT][2];
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int m = 0; m < 2; m++) {
			rw_sim_opts_t o = exact((rw_sim_model_t)m);
			rw_sim_report_t rep, again;
			assert_int_equal(rw_sim_path(&topo, &fab, &o, (rw_path_t)p, counts, rec, 0, &rep), RW_OK);
			assert_int_equal(rep.run.violations, 0);
			assert_true(rep.ratio >= 1 - 1e-9); /* nothing beats the lower bound */
			assert_close(rep.lower_bound, lb, 1e-12);
			/* Never faster than the path's own busiest NIC. */
			assert_true(rep.run.time >= rep.busiest.seconds * (1 - 1e-9));
			assert_close(rep.busiest.seconds,
				     (double)rw_sched_busiest_nic(&topo, (rw_path_t)p, counts) * rec / GBPS(100), 1e-12);
			exact_time[p][m] = rep.run.time;
			/* Same input, same output, bit for bit. */
			assert_int_equal(rw_sim_path(&topo, &fab, &o, (rw_path_t)p, counts, rec, 0, &again), RW_OK);
			assert_true(again.run.time == rep.run.time && again.run.events == rep.run.events);
			/* Batching (the default 1e-3) stays within 1% of the exact run. */
			o.batch_eps = 1e-3;
			assert_int_equal(rw_sim_path(&topo, &fab, &o, (rw_path_t)p, counts, rec, 0, &again), RW_OK);
			assert_close(again.run.time, rep.run.time, 0.01);
			/* Combine sends the same records back: the reversed flows, same busiest NIC
			 * work at the same record size. */
			assert_int_equal(rw_sim_path(&topo, &fab, &o, (rw_path_t)p, counts, rec, 1, &again), RW_OK);
			assert_close(again.busiest.seconds, rep.busiest.seconds, 1e-12);
		}
	/* Skewed rails (rail-skew 0.7): the balanced paths beat their native counterparts. */
	for (int m = 0; m < 2; m++) {
		assert_true(exact_time[RW_PATH_RAIL_ONLY][m] < exact_time[RW_PATH_NATIVE][m]);
		assert_true(exact_time[RW_PATH_JOINT][m] < exact_time[RW_PATH_PERM_ONLY][m]);
	}
	free(counts);
}

static void test_path_flows(void **state)
{
	(void)state;
	/* Flows are the plans' quotas: bytes per (src, rail) equal plan.egress x record size, waves
	 * are wave_of(src, dst) on waved paths (combine: of the reversed pair), 0 otherwise. */
	const uint32_t N = 6, G = 4, R = 4;
	rw_topo_t topo;
	uint32_t *counts = synth_counts(&topo, N, G, R, 9, 0.3);
	rw_pair_plan_t pairs[6];
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int combine = 0; combine < 2; combine++) {
			rw_sim_flow_t *fl;
			size_t n;
			assert_int_equal(rw_sim_path_flows(&topo, (rw_path_t)p, counts, 100, combine, &fl, &n), RW_OK);
			double out[6 * 4] = { 0 };
			for (size_t i = 0; i < n; i++) {
				uint32_t s = combine ? fl[i].dst : fl[i].src, d = combine ? fl[i].src : fl[i].dst;
				out[s * R + fl[i].rail] += fl[i].bytes;
				uint32_t want = rw_path_waved((rw_path_t)p) ? rw_sched_wave_of(N, fl[i].src, fl[i].dst) : 0;
				assert_int_equal(fl[i].wave, want);
				assert_true(d != s);
			}
			for (uint32_t s = 0; s < N; s++) {
				rw_phase_plan_t plan = { .pairs = pairs };
				assert_int_equal(rw_sched_plan_build(&topo, (rw_path_t)p, s, counts, &plan), RW_OK);
				for (uint32_t r = 0; r < R; r++)
					assert_true(out[s * R + r] == (double)plan.egress[r] * 100);
			}
			free(fl);
		}
	free(counts);
}

static void test_fold_fan_in(void **state)
{
	(void)state;
	const uint32_t N = 8, G = 2, R = 2;
	rw_topo_t topo;
	uint32_t *counts = synth_counts(&topo, N, G, R, 5, 0);
	uint32_t *out = malloc(sizeof(uint32_t) * N * N * R);
	assert_non_null(out);
	for (uint32_t k = 1; k < N; k++) {
		rw_sim_fold_fan_in(N, R, k, counts, out);
		rw_features_t f;
		rw_sched_features(&topo, out, 1, &f);
		assert_int_equal(f.max_fan_in, k);
		for (uint32_t s = 0; s < N; s++)
			for (uint32_t r = 0; r < R; r++) {
				uint64_t a = 0, b = 0;
				for (uint32_t d = 0; d < N; d++) {
					if (d == s)
						continue;
					a += counts[(s * N + d) * R + r];
					b += out[(s * N + d) * R + r];
				}
				assert_true(a == b); /* every source keeps its bytes per rail */
				assert_int_equal(out[(s * N + s) * R + r], 0);
			}
	}
	free(out);
	free(counts);
}

/* ---- the subcommand ------------------------------------------------------------------------ */

static char *run_sim(int *rc_p, int argc, char **argv)
{
	return run_captured(rw_tool_sim, rc_p, argc, argv);
}

static void test_command(void **state)
{
	(void)state;
	int rc;
	char *tab[] = { "sim", "--nodes", "4", "--rails", "2", "--gpus", "2", "--tokens", "64",
			"--shape", "glm", "--seed", "11", "--model", "both", "--rail-skew", "0.5", NULL };
	char *out = run_sim(&rc, 17, tab);
	assert_int_equal(rc, 0);
	assert_non_null(strstr(out, "seed 11"));
	assert_non_null(strstr(out, "selector: joint (no-table)"));
	for (int p = 0; p < RW_PATH_COUNT; p++)
		assert_non_null(strstr(out, rw_sched_path_name((rw_path_t)p)));
	free(out);

	char *js[] = { "sim", "--nodes", "4", "--rails", "2", "--gpus", "2", "--tokens", "64",
		       "--model", "both", "--fan-in", "2", "--json", NULL };
	out = run_sim(&rc, 14, js);
	assert_int_equal(rc, 0);
	json_error_t err;
	json_t *doc = json_loads(out, 0, &err);
	assert_non_null(doc);
	assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "features"), "max_fan_in")), 2);
	json_t *paths = json_object_get(doc, "paths");
	assert_int_equal(json_object_size(paths), RW_PATH_COUNT);
	const char *name;
	json_t *pj;
	json_object_foreach(paths, name, pj) {
		for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
			json_t *mj = json_object_get(pj, rw_sim_model_name((rw_sim_model_t)m));
			assert_non_null(mj);
			assert_true(json_number_value(json_object_get(mj, "ratio")) >= 1 - 1e-9);
		}
	}
	json_decref(doc);
	free(out);

	char *bad[] = { "sim", "--model", "lossy", NULL };
	out = run_sim(&rc, 3, bad);
	assert_int_equal(rc, 2);
	free(out);
	char *bad_fan[] = { "sim", "--nodes", "4", "--fan-in", "4", NULL };
	out = run_sim(&rc, 5, bad_fan);
	assert_int_equal(rc, 2);
	free(out);
}

static void test_command_testbed(void **state)
{
	(void)state;
	/* A `railwave bench`-shaped result with one point and made-up medians: the replay
	 * simulates the same workload and reports sim / measured per path and phase. */
	char path[] = "/tmp/rw-test-bench-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	const char *doc =
		"{\"nodes\": 3, \"rails\": 2, \"gpus\": 2, \"mbit\": 50, \"points\": [{\"axis\": \"rail-skew\","
		" \"workload\": {\"experts\": 128, \"topk\": 8, \"hidden\": 512, \"tokens\": 40, \"zipf\": 0.8,"
		" \"dirichlet\": 20, \"rail_skew\": 0.7, \"seed\": 3, \"layer\": 0}, \"results\": {"
		" \"native\": {\"dispatch\": {\"median\": 0.5}, \"combine\": {\"median\": 0.4}},"
		" \"rail-only\": {\"dispatch\": {\"median\": 0.3}, \"combine\": {\"median\": 0.2}},"
		" \"perm-only\": {\"dispatch\": {\"median\": 0.6}, \"combine\": {\"median\": 0.5}},"
		" \"joint\": {\"dispatch\": {\"median\": 0.35}, \"combine\": {\"median\": 0.3}}}}]}";
	assert_int_equal(write(fd, doc, strlen(doc)), (ssize_t)strlen(doc));
	close(fd);
	int rc;
	char *argv[] = { "sim", "--testbed", path, "--model", "maxmin", "--json", NULL };
	char *out = run_sim(&rc, 6, argv);
	unlink(path);
	assert_int_equal(rc, 0);
	json_error_t err;
	json_t *res = json_loads(out, 0, &err);
	assert_non_null(res);
	json_t *pt = json_array_get(json_object_get(res, "points"), 0);
	assert_non_null(pt);
	json_t *nat = json_object_get(json_object_get(pt, "dispatch"), "native");
	double meas = json_number_value(json_object_get(nat, "measured_s"));
	json_t *mm = json_object_get(nat, "maxmin");
	double sim = json_number_value(json_object_get(mm, "sim_s"));
	assert_close(meas, 0.5, 1e-12);
	assert_true(sim > 0);
	assert_close(json_number_value(json_object_get(mm, "sim_over_measured")), sim / meas, 1e-9);
	json_decref(res);
	free(out);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_single_flow),
		cmocka_unit_test(test_incast_two),
		cmocka_unit_test(test_wave_gate),
		cmocka_unit_test(test_maxmin_classic),
		cmocka_unit_test(test_congestion_spreading),
		cmocka_unit_test(test_hol_weight),
		cmocka_unit_test(test_waves_sum_of_maxima),
		cmocka_unit_test(test_random_properties),
		cmocka_unit_test(test_order_and_threads),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_paths),
		cmocka_unit_test(test_path_flows),
		cmocka_unit_test(test_fold_fan_in),
		cmocka_unit_test(test_command),
		cmocka_unit_test(test_command_testbed),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
