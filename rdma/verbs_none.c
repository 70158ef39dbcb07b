/* Stands in for rdma/verbs.c in librdma.a when configure found no rdma-core headers: the
 * registry (rail.c) then lists tcp only. */
typedef int rw_rail_verbs_absent_t;
