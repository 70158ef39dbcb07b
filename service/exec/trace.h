/* Phase traces (docs/service.md "Phase traces"): with `trace_dir` set, the executor keeps what
 * each phase did — key, path and why, the count matrix, per-wave and per-rail times and bytes,
 * grant waits, who was last — and service/exec/trace.c writes one JSON line per phase. Private to the
 * executor: exec_int.h includes it after the pair's definition. Each hook is one call in the
 * executor's files; it does nothing (one branch) when tracing is off. Loop thread only. */
#ifndef RW_SVC_TRACE_H
#define RW_SVC_TRACE_H

#include <stdint.h>

#include "common/common.h"
#include "sched/sched.h"
#include "service/core/svc.h"

#define EXEC_TRACE_FULL_COUNTS 4096u /* N*N*R above this: per-node and per-rail sums instead */

/* One send wave of a kind (non-waved paths: wave 1 carries every destination). */
typedef struct exec_trace_wave {
	uint64_t post_ns, done_ns;   /* first write posted; every write of the wave acknowledged */
	uint64_t wait_ns, grant_ns;  /* waited for the destination's grant from .. to */
	uint64_t bytes;
	uint32_t writes;
} exec_trace_wave_t;

/* Bytes of a kind from one (source, rail): first arrival to the range's completion. */
typedef struct exec_trace_range {
	uint64_t first_ns, done_ns, bytes;
} exec_trace_range_t;

typedef struct exec_trace_rail {
	uint64_t first_ns, last_ns;  /* first and last write posted on the rail */
	uint64_t bytes;
	uint32_t writes, last_wave;
} exec_trace_rail_t;

typedef struct exec_trace_kind {
	uint64_t t0_ns;              /* the kind's first local submission (rw_now_ns) */
	uint64_t last_submit_ns, ready_ns, run_ns, end_ns;
	uint32_t last_local;         /* local index of the last rank to submit */
	uint32_t submitted;          /* bit g: local rank g submitted this kind */
	int32_t last_peer;           /* node whose range completed last (-1: none) */
	uint64_t last_peer_ns;
	exec_trace_rail_t tx[RW_MAX_RAILS];
	exec_trace_wave_t *wave;     /* [N], index = wave */
	exec_trace_range_t *rx;      /* [N*R] */
	uint64_t *granted_ns;        /* [N]: when this node granted wave k to its source */
} exec_trace_kind_t;

/* What a pair keeps while tracing; carved from the pair's arena (gone when the pair closes). */
typedef struct exec_trace_pair {
	uint64_t wall0_ns, mono0_ns; /* CLOCK_REALTIME and rw_now_ns() at the pair's opening */
	char group[64];
	int have_sel;
	uint64_t decided_ns;
	rw_features_t feat;
	rw_selection_t sel;
	exec_trace_kind_t k[RW_SVC_KIND_COUNT];
} exec_trace_pair_t;

typedef struct rw_svc_trace rw_svc_trace_t;
struct exec_pair;
struct rw_svc_exec;

/* Start recording into cfg.trace_dir (no-op when empty). Never fails the daemon: an
 * unwritable directory is logged once and counted, and opening is retried at every flush. */
void exec_trace_start(struct rw_svc_exec *x);
/* Flush what is buffered, close the file, free the recorder. */
void exec_trace_stop(struct rw_svc_exec *x);

/* Counters of the recorder (logged when it stops): records written, records dropped (buffer
 * full, write failed), write/open failures, bytes, rotations, and the loop time spent ending
 * records (building, buffering, and the writes they triggered). Zero when tracing is off. */
typedef struct exec_trace_counters {
	uint64_t records, dropped, errors, bytes, rotations, ended, end_ns;
} exec_trace_counters_t;

/* The hooks' bodies (trace.c); call them through the inline wrappers below. */
void exec_trace_open_(struct exec_pair *p);
void exec_trace_submit_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t local);
void exec_trace_mark_(struct exec_pair *p, rw_svc_phase_kind_t kind, int what);
void exec_trace_decided_(struct exec_pair *p);
void exec_trace_wave_post_(struct exec_pair *p);
void exec_trace_wave_done_(struct exec_pair *p);
void exec_trace_grant_wait_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t wave);
void exec_trace_granted_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t wave);
void exec_trace_grant_sent_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t wave);
void exec_trace_tx_(struct exec_pair *p, uint32_t rail, uint64_t bytes);
void exec_trace_rx_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail,
		    uint64_t bytes);
void exec_trace_range_done_(struct exec_pair *p, rw_svc_phase_kind_t kind, uint32_t src,
			    uint32_t rail);
/* The kind ended (st RW_OK: completed; else failed with the pair's recorded error): write it. */
void exec_trace_end_(struct exec_pair *p, rw_svc_phase_kind_t kind, rw_status_t st);

#endif /* RW_SVC_TRACE_H */
