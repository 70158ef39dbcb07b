/* The peer mesh's private header (service/mesh/mesh.h is its face to the daemon): the mesh, its peers,
 * control connections and rail connections, and what its files share. The files, in call order
 * (no file calls back up it):
 *   mesh_setup.c  create and destroy: devices, memory, listeners, timers.
 *   mesh_session.c control sessions: connect, accept, the authenticated handshake, messages,
 *                 heartbeats (calls mesh.c to change a peer).
 *   mesh.c        peers: state, failure, reconnection, rail connections, the API.
 *   mesh_ctl.c    a control connection's bytes: framing, queueing, flushing (returns statuses).
 *   mesh_rail.c   a rail connection's write queue, busy time and counters; rail health: a rail
 *                 that fails alone, its background reconnect, the test switch.
 *   mesh_auth.c   the cluster key, nonces, proofs and session keys (libsodium; returns statuses).
 *   mesh_carve.c  the groups' carve-outs: the pool, their memfds and regions, CARVE in and out,
 *                 and where an offset of the mesh's memory lies (returns statuses). */
#ifndef RW_SVC_MESH_INT_H
#define RW_SVC_MESH_INT_H

#include <sys/types.h>

#include "common/listen_pause.h"
#include "service/mesh/mesh.h"
#include "service/mesh/rail_health.h"
#include "service/core/svc.h"

#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 2000
#define CTL_TX_MAX (64u << 20) /* a peer that lets this much control data pile up is dropped */
#define UNKNOWN_MAX 64         /* strangers' control connections that have not authenticated yet */
#define MEMBER_WAIT_MAX 4      /* per configured node address: its own budget, beside the strangers' */
#define MESH_KEY_SIZE 32       /* cluster key and session key: crypto_auth keys */

typedef struct mesh_wq {
	struct mesh_wq *next;
	rw_rail_write_t w;
	rw_status_t st;               /* a held completion's (mesh_rail_t.held) */
} mesh_wq_t;



struct mesh_peer;

typedef struct mesh_rail {
	int is_rail;                  /* 1: tells a connection's context from the listener's (mesh) */
	struct mesh_peer *peer;
	uint32_t rail;
	rw_rail_conn_t *conn;
	int up;
	int blocked;                  /* rw_rail_write said AGAIN; waiting for on_writable */
	mesh_wq_t *head, *tail;       /* posted first, then queued */
	uint32_t posted;              /* the first `posted` entries are with the transport */
	uint64_t progress_ns;         /* last write handed over with none posted, or completed */
	int fail_soon;                /* the transport refused a write: fail it from the loop */
	/* A failure waiting for its verdict (mesh_settle_verdict): the rail posts nothing
	 * meanwhile, and its failed writes' completions are held, oldest first. */
	int settling;
	int settle_error;             /* its connection failed (on_error), not only a write */
	rw_status_t settle_st;
	char settle_why[64];
	mesh_wq_t *held, *held_tail;
	rw_svc_rail_health_t health;  /* outages while the peer stayed up (rail_health.h) */
	ev_timer retry;               /* background reconnect of a rail that failed alone */
	uint64_t dial;                /* this session's rail dials: the connector's last, the
	                               * acceptor's last taken (mesh_auth_rail_proof) */
} mesh_rail_t;

typedef struct mesh_ctl {
	rw_svc_mesh_t *mesh;
	struct mesh_ctl *next;        /* unidentified list */
	int fd;
	int connecting;               /* outgoing connect() in progress */
	int peer;                     /* -1 until it has proven the key (accepted connections) */
	uint32_t src;                 /* accepted: the source IPv4 address (network order) */
	int member_src;               /* accepted from a configured node's control address: it waits
	                               * in that address's budget (MEMBER_WAIT_MAX), not the strangers' */
	ev_io io;
	uint64_t opened_ns;
	uint8_t hdr[RW_WIRE_HDR_SIZE];
	uint32_t hdr_have;
	rw_wire_hdr_t cur;
	uint8_t *rx;                  /* payload of an authenticated connection's frame */
	uint32_t rx_have;
	/* The handshake (docs/security.md "Peer authentication"): until `authed` only a HELLO and
	 * an AUTH of their fixed sizes are read, into `pre` (nothing allocated for a stranger). */
	uint8_t pre[RW_WIRE_HELLO_SIZE];
	int authed;                   /* the peer proved the cluster key on this connection */
	int hello_in;                 /* its HELLO came (claim, nonce_peer are set) */
	uint32_t claim;               /* the node its HELLO named */
	uint64_t claim_boot;          /* and that hello's boot id */
	uint8_t nonce_mine[RW_WIRE_NONCE_SIZE], nonce_peer[RW_WIRE_NONCE_SIZE];
	int regions_sent;             /* our REGIONS went out on it: CARVEs may follow */
	char why[160];                /* a failure message built for this connection */
	uint8_t *tx;
	size_t tx_len, tx_off, tx_cap;
} mesh_ctl_t;

typedef struct mesh_peer {
	rw_svc_mesh_t *mesh;
	uint32_t idx;
	rw_svc_peer_state_t state;
	mesh_ctl_t *ctl;              /* identified control channel, or NULL */
	int hello_ok;                 /* authenticated and its REGIONS came: rails may connect */
	uint8_t session[MESH_KEY_SIZE]; /* this control session's key (rail proofs) */
	uint64_t boot_id;
	rw_rail_remote_t remote[RW_MAX_RAILS];
	rw_rail_remote_t *carve_remote; /* [carve_max * rails]: its carve-outs' regions (CARVE) */
	uint8_t *carve_known;         /* [carve_max]: a CARVE of that index came this session */
	char rail_addr[RW_MAX_RAILS][RW_WIRE_ADDR_MAX];
	mesh_rail_t rail[RW_MAX_RAILS];
	uint64_t last_rx_ns;
	uint64_t last_stamp;          /* newest heartbeat stamp from the peer (echoed back) */
	uint64_t last_stamp_rx_ns;    /* when it came */
	int said_bye;                 /* it sent BYE: its close is a clean stop, not a failure */
	ev_timer retry;
	uint32_t backoff_ms;
	/* Joining: authenticated but not every rail connected yet. After heartbeat_timeout_ms it
	 * comes up on the rails that did (mesh_rail_join_cb); the others are down and redialed. */
	ev_timer join;
	/* A rail failed while the control channel looked alive: a rail's own failure, or the first
	 * close of a peer that died (its control connection's close may come later, even tens of ms
	 * on a loaded host). A heartbeat stamped settle_stamp went out then; the peer's echo of it
	 * proves it lives (the rail failed alone), its control connection's close that it died; the
	 * settle timer (heartbeat_timeout_ms) bounds the wait. */
	uint64_t settle_stamp;        /* 0: no rail of this peer waits */
	ev_timer settle;
	/* A failure found inside a mesh call (a send, a write, fail_peer): carried out by fail_cb
	 * from the loop, so the caller never sees write_done or peer_down inside its own call
	 * (mesh.h). Until then the peer counts as down for sends and writes. */
	int failing;
	rw_status_t fail_st;
	char fail_why[128];
} mesh_peer_t;

/* One group's carve-out (mesh_carve.c): on every rail a sealed memfd of carve_bytes, mapped
 * here and registered with the rail, its index named to the peers by CARVE. */
typedef struct mesh_carve {
	uint32_t refs;                /* 0: free */
	char group[RW_WIRE_GROUP_MAX];
	int fd[RW_MAX_RAILS];         /* what a rank of the group is lent (shm: the transport's) */
	uint8_t *mem[RW_MAX_RAILS];
	rw_rail_region_t *region[RW_MAX_RAILS];
	struct rw_cuda_vmm *vmm[RW_MAX_RAILS]; /* GPU memory (carve_dev): lent by its fd */
	/* A GPU carve-out's page-locked host shadow (the checks read the records' headers there,
	 * pulled: service/mover/mover_pull.c), the rail's own mapping of the export where the rail
	 * reads memory through the CPU and the daemon's mapping is not readable (nic, the test
	 * hook's tcp), and whether the daemon's CPU reads and writes every rail's memory in place. */
	uint8_t *shadow[RW_MAX_RAILS];
	uint8_t *nic[RW_MAX_RAILS];
	int cpu;
	/* A copy queued on a GPU may still read or write it (rw_svc_mesh_carve_leave): when it goes,
	 * its memory is left to the process's exit, never freed. Why, for the log; "": freed. */
	char left[160];
} mesh_carve_t;

struct rw_svc_mesh {
	int is_rail;                  /* 0 (see mesh_rail_t) */
	rw_svc_t *svc;
	struct ev_loop *loop;
	rw_svc_mesh_cbs_t cbs;
	void *ctx;
	uint32_t nodes, rails, me;
	uint64_t area_bytes;
	uint64_t boot_id, fingerprint;
	int keyed;                    /* a cluster key is loaded (else "auth none": a zero key) */
	uint8_t key[MESH_KEY_SIZE];
	uint64_t auth_refused;        /* handshakes refused for a bad or missing proof */
	uint64_t auth_refused_logged; /* auth_refused at the last log line */
	uint64_t auth_log_ns;         /* when that line was written */
	uint32_t tx_seq;
	rw_rail_dev_t *dev[RW_MAX_RAILS];
	uint8_t *mem[RW_MAX_RAILS];
	rw_rail_region_t *region[RW_MAX_RAILS];
	/* Where the slabs are (mesh_slabs.c): slab_dev -1, host memory mem[r]; else GPU memory at
	 * slab_dptr of that device, exported as dmabuf slab_fd, and mem[r] is its host shadow. */
	int slab_dev[RW_MAX_RAILS];
	uint64_t slab_dptr[RW_MAX_RAILS];
	int slab_fd[RW_MAX_RAILS];
	char host_why[128];           /* why the first host-memory rail is not on a GPU */
	/* Where the groups' carve-outs are (mesh_slabs.c): -1 host memory, else GPU memory of
	 * that device (the rail's slabs' GPU, or under the test hook the GPU beside the rail). */
	int carve_dev[RW_MAX_RAILS];
	char carve_why[160];          /* why the last carve-out could not be made */
	/* Carve-outs (mesh_carve.c): offsets of the mesh's memory past area_bytes are carve-out
	 * (offset - area_bytes) / carve_bytes, the same numbers on every node. */
	uint64_t carve_bytes;         /* per rail and group; 0: no carve-outs */
	uint32_t carve_max;           /* the pool: carve-outs at once */
	mesh_carve_t *carve;          /* [carve_max] */
	rw_rail_listener_t *listener[RW_MAX_RAILS];
	uint32_t inflight[RW_MAX_RAILS];   /* our writes outstanding per rail, all peers */
	uint64_t busy_since[RW_MAX_RAILS]; /* when inflight last went 0 -> 1 */
	int listen_fd;
	ev_io listen_io;
	rw_listen_pause_t listen_pause; /* rests the listener when descriptors run out */
	uint32_t n_unknown;           /* strangers' accepted control connections before the proof */
	uint32_t *ctl_members;        /* [me]: the control addresses of the nodes that dial us */
	ev_timer hb_timer;
	uint64_t hb_last_ns;          /* when mesh_hb_cb last ran, or the timer started */
	ev_timer fail_timer;          /* runs the peers' deferred failures (peer_fail_soon) */
	rw_status_t (*dial)(struct mesh_rail *mr); /* mesh.c's mesh_rail_dial, for mesh_rail.c's redials */
	rw_svc_rail_fault_t fault;    /* test switch RAILWAVE_TEST_RAIL_DOWN */
	ev_timer fault_timer;
	mesh_peer_t *peer;            /* [nodes] */
	mesh_ctl_t *unknown;          /* accepted control connections before the proof, newest first */
};

typedef void (*mesh_io_cb_t)(struct ev_loop *loop, ev_io *w, int revents);

/* ---- mesh_ctl.c --------------------------------------------------------------------------- */
mesh_ctl_t *mesh_ctl_new(rw_svc_mesh_t *m, int fd, int peer, mesh_io_cb_t io_cb);
void mesh_ctl_free(mesh_ctl_t *c);                     /* NULL ok */
void mesh_unknown_remove(rw_svc_mesh_t *m, mesh_ctl_t *c);
void mesh_ctl_update_events(mesh_ctl_t *c);
int mesh_ctl_flush(mesh_ctl_t *c);                     /* -1: write error */
/* RW_ERR_AGAIN: more than CTL_TX_MAX queued; RW_ERR_NOMEM. */
rw_status_t mesh_ctl_queue(mesh_ctl_t *c, uint16_t type, const uint8_t *payload, uint32_t len);
int mesh_ctl_bye_pending(const mesh_ctl_t *c);
/* The other side closed (or reset) the connection, whatever is still unread before the close:
 * a rail that fails then is part of the peer's failure, not a rail's own. */
int mesh_ctl_peer_closed(const mesh_ctl_t *c);
/* Read what is there: 1 with a whole frame (*payload_p: its bytes, NULL when empty, owned by c
 * and valid until the next call or mesh_ctl_free); 0 when nothing more is there now; -1 when
 * the connection is finished (*st_p, *why_p). Before c->authed only a HELLO and an AUTH of
 * their sizes are taken. */
int mesh_ctl_read_frame(mesh_ctl_t *c, rw_wire_hdr_t *h_p, uint8_t **payload_p, rw_status_t *st_p,
			const char **why_p);

/* ---- mesh_carve.c ------------------------------------------------------------------------- */
rw_status_t mesh_carve_init(rw_svc_mesh_t *m, uint64_t carve_bytes, uint32_t carve_max);
void mesh_carve_fini(rw_svc_mesh_t *m);
/* Queue a CARVE for every live carve-out on c, right after our REGIONS (RW_ERR_NOMEM,
 * RW_ERR_AGAIN: the caller drops the connection). */
rw_status_t mesh_carve_announce_all(mesh_ctl_t *c);
/* A peer's CARVE: RW_ERR_PROTO when malformed or past the pool (the caller drops the peer). */
rw_status_t mesh_carve_on_msg(mesh_peer_t *p, const uint8_t *payload, uint32_t len);
/* Where [off, off + len) of the mesh's memory lies on `rail`: our region and the offset in it;
 * RW_ERR_RANGE outside the shared area or one live carve-out. */
rw_status_t mesh_carve_local(const rw_svc_mesh_t *m, uint32_t rail, uint64_t off, uint64_t len,
			     rw_rail_region_t **region_p, uint64_t *at_p);
/* The same for the peer's memory: its region (REGIONS or CARVE) and the offset in it. */
rw_status_t mesh_carve_remote(const mesh_peer_t *p, uint32_t rail, uint64_t off, uint64_t len,
			      rw_rail_remote_t *remote_p, uint64_t *at_p);
/* An arrival's (region, offset) as an offset of the mesh's memory; 0 when the region is none
 * of ours (the arrival is then reported without a place). */
int mesh_carve_offset(const rw_svc_mesh_t *m, uint32_t rail, const rw_rail_region_t *region,
		      uint64_t offset, uint64_t *off_p);

/* ---- mesh_rail.c -------------------------------------------------------------------------- */
void mesh_busy_begin(rw_svc_mesh_t *m, uint32_t rail);
void mesh_busy_end(rw_svc_mesh_t *m, uint32_t rail);
void mesh_rail_dev_sample(rw_svc_mesh_t *m, uint32_t rail);
/* Complete every queued write with st (write_done callbacks). */
void mesh_rail_reclaim(mesh_rail_t *mr, rw_status_t st);
void mesh_rail_close(mesh_rail_t *mr, rw_status_t st);
/* The held completions of a settling rail, delivered (oldest first); it settles no more. */
void mesh_rail_release_held(mesh_rail_t *mr);
/* Hand queued writes to the transport until it pushes back. RW_ERR_LINK: it refused one (the
 * caller fails the peer). */
rw_status_t mesh_rail_pump(mesh_rail_t *mr);
mesh_rail_t *mesh_rail_of(rw_rail_conn_t *conn, void *ctx);
uint32_t mesh_rails_up(const mesh_peer_t *p);
/* Copy the peer's rail states into the metrics. */
void mesh_rails_publish(mesh_peer_t *p);
/* Rail mr failed while its peer stays up (the caller checked that another rail lives): mark it
 * down, tell the executor (rail_down), complete its writes with errors, reconnect with back-off
 * (the lower node dials; the higher one waits for the accept). */
void mesh_rail_fail(mesh_rail_t *mr, rw_status_t st, const char *why);
/* mr is connected (again): ends its outage. */
void mesh_rail_joined(mesh_rail_t *mr);
/* The peer went down or the mesh stops: no more background reconnects; the outage ends. */
void mesh_rail_reset(mesh_rail_t *mr);
void mesh_rail_retry_cb(struct ev_loop *loop, ev_timer *w, int revents);
void mesh_rail_fault_cb(struct ev_loop *loop, ev_timer *w, int revents);
/* The peer came up: arm the test switch if it names this peer. */
void mesh_rail_fault_arm(mesh_peer_t *p);
/* A rail that fails or cannot be dialed while its peer joins: down, not the peer's failure
 * (a node whose NIC is dead still joins on its other rails). */
void mesh_rail_join_fail(mesh_rail_t *mr, rw_status_t st, const char *why);
/* Dial mr again after its back-off (the lower node dials; the higher one waits). */
void mesh_rail_schedule(mesh_rail_t *mr);

/* ---- mesh_auth.c -------------------------------------------------------------------------- */
typedef enum mesh_auth_role {
	MESH_AUTH_CONNECTOR = 1,      /* the lower node index: it opened the connection */
	MESH_AUTH_ACCEPTOR = 2,
} mesh_auth_role_t;

/* What a handshake binds: both node ids, the configuration fingerprint, both nonces. */
typedef struct mesh_auth_ids {
	uint32_t connector, acceptor;
	uint64_t fingerprint;
	uint8_t nonce_c[RW_WIRE_NONCE_SIZE], nonce_a[RW_WIRE_NONCE_SIZE];
} mesh_auth_ids_t;

rw_status_t mesh_auth_init(void);                      /* RW_ERR_SYS: libsodium unusable */
/* Read a key file: 64 hex digits (railwave keygen). RW_ERR_INVAL: group/world bits in its
 * mode; RW_ERR_PARSE: not a key; RW_ERR_NOTFOUND, RW_ERR_SYS. `why` says which, naming path. */
rw_status_t mesh_auth_key_load(const char *path, uint8_t key_p[MESH_KEY_SIZE], char *why,
			       size_t why_len);
void mesh_auth_nonce(uint8_t nonce[RW_WIRE_NONCE_SIZE]);
void mesh_auth_proof(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		     mesh_auth_role_t role, uint8_t proof[RW_WIRE_PROOF_SIZE]);
/* 1 when proof is role's proof over ids with key (constant-time compare). */
int mesh_auth_proof_ok(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		       mesh_auth_role_t role, const uint8_t proof[RW_WIRE_PROOF_SIZE]);
void mesh_auth_session(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		       uint8_t session[MESH_KEY_SIZE]);
/* A rail handshake's proof for dial number `dial` (>= 1) of (peer, rail) in this session. */
void mesh_auth_rail_proof(const uint8_t session[MESH_KEY_SIZE], mesh_auth_role_t role,
			  uint32_t rail, uint64_t dial, uint8_t proof[RW_RAIL_PROOF_SIZE]);
/* 1 when proof is role's for rail with the session key; *dial_p: the dial it names. */
int mesh_auth_rail_proof_ok(const uint8_t session[MESH_KEY_SIZE], mesh_auth_role_t role,
			    uint32_t rail, const uint8_t proof[RW_RAIL_PROOF_SIZE], uint64_t *dial_p);
void mesh_auth_wipe(void *p, size_t len);

/* ---- mesh.c (for mesh_setup.c and mesh_session.c) ------------------------------------------ */
extern const rw_rail_conn_cbs_t mesh_rail_cbs;
void mesh_fail_cb(struct ev_loop *loop, ev_timer *w, int revents);
/* A rail failure's verdict: the peer echoed the heartbeat sent at the failure (it lives: the
 * rails fail alone), or the wait is over (data: the peer): its control connection closed (the
 * peer died) or not. */
void mesh_settle_verdict(mesh_peer_t *p);
void mesh_settle_cb(struct ev_loop *loop, ev_timer *w, int revents);
/* A heartbeat to peer p stamped `now`, echoing the peer's latest stamp. */
void mesh_hb_send(mesh_peer_t *p, uint64_t now);
void mesh_peer_set_state(mesh_peer_t *p, rw_svc_peer_state_t s);
const char *mesh_peer_name(const rw_svc_mesh_t *m, uint32_t idx);
/* Take the peer down now: its control session and rails closed, writes completed with errors,
 * peer_down if it was up, a reconnect scheduled. Only from the loop, never inside a mesh call. */
void mesh_peer_fail(mesh_peer_t *p, rw_status_t st, const char *why);
/* UP once authenticated and every rail is connected; with some rails only, the join timer
 * decides (mesh_rail_join_cb). */
void mesh_peer_check_up(mesh_peer_t *p);
/* The joining peer's wait for its rails is over (heartbeat_timeout_ms after its hello): it comes
 * up on the rails that connected, the others down and redialed; with none it fails. */
void mesh_peer_join_cb(struct ev_loop *loop, ev_timer *w, int revents);
void mesh_peer_connect_rails(mesh_peer_t *p);     /* the connector's rails, with their proofs */
/* Dial rail mr of its peer (the connector's side), with the next dial number's proof. */
rw_status_t mesh_rail_dial(mesh_rail_t *mr);
/* A rail whose posted writes made no progress for `stall` ns is dead even if its connection
 * says nothing (a link that went down under TCP): it fails alone, or takes the peer down when
 * it was the last. Returns 1 when the peer went down. */
int mesh_rail_stalled(mesh_peer_t *p, uint64_t now, uint64_t stall);
void mesh_peer_schedule_retry(mesh_peer_t *p);

/* ---- mesh_session.c (for mesh_setup.c) ---------------------------------------------------- */
void mesh_retry_cb(struct ev_loop *loop, ev_timer *w, int revents);
void mesh_listen_cb(struct ev_loop *loop, ev_io *w, int revents);
void mesh_hb_cb(struct ev_loop *loop, ev_timer *w, int revents);
void mesh_peer_connect(mesh_peer_t *p);

/* mesh_slabs.c: place rail r's slabs (GPU memory registered through a dmabuf, else the host
 * memory mem[r] registered), logged; the `stats` line once every rail is placed; free rail r's
 * GPU slabs (after its region is deregistered). */
rw_status_t mesh_slabs_place(rw_svc_mesh_t *m, uint32_t r);
void mesh_slabs_summary(rw_svc_mesh_t *m);
void mesh_slabs_free(rw_svc_mesh_t *m, uint32_t r);

#endif /* RW_SVC_MESH_INT_H */
