/* common/wire_rec.h: the byte layout of the records a dispatch and a combine write into a
 * peer's receive region (docs/dataflow.md "Record formats"), for the two writers that must
 * agree on it: railwaved's host code (service/phase/wire.h, which includes this and packs and
 * checks the headers) and the rank's kernels (cuda/rank_kernels.cu, compiled by nvcc, which
 * reads this as C++). Constants and size arithmetic only; little-endian fields.
 *
 * Dispatch record, record size bytes, 16-byte aligned:
 *   u32 tag | u16 src_node | u16 owner (local GPU index of the owning rank) | u32 token |
 *   u16 topk | u16 reserved | i32 ids[topk] | f32 weights[topk] | pad to 16 | row | pad to 16
 * Combine record (one per dispatch record, returned along the same (egress rail, slot)):
 *   u32 tag | u16 src_node (the expert node) | u16 egress rail | u32 slot | u32 reserved | row */
#ifndef RW_COMMON_WIRE_REC_H
#define RW_COMMON_WIRE_REC_H

#include <stdint.h>

#ifdef __CUDACC__
#define RW_WIRE_REC_FN static inline __host__ __device__
#else
#define RW_WIRE_REC_FN static inline
#endif

#define RW_WIRE_REC_HDR 16   /* dispatch record header; the top-k block follows */
#define RW_WIRE_REC_TAG 0    /* u32 */
#define RW_WIRE_REC_SRC 4    /* u16 source node */
#define RW_WIRE_REC_OWNER 6  /* u16 owning rank's local GPU index */
#define RW_WIRE_REC_TOKEN 8  /* u32 */
#define RW_WIRE_REC_TOPK 12  /* u16, then u16 reserved (0) */

#define RW_WIRE_CREC_HDR 16  /* combine record header; the row follows */
#define RW_WIRE_CREC_TAG 0   /* u32 */
#define RW_WIRE_CREC_SRC 4   /* u16 source (expert) node */
#define RW_WIRE_CREC_RAIL 6  /* u16 egress rail */
#define RW_WIRE_CREC_SLOT 8  /* u32, then u32 reserved (0) */

RW_WIRE_REC_FN uint64_t rw_wire_align16(uint64_t x) { return (x + 15u) & ~(uint64_t)15u; }
/* Offset of the row inside a dispatch record. */
RW_WIRE_REC_FN uint64_t rw_wire_rec_row_off(uint32_t topk)
{
	return rw_wire_align16(RW_WIRE_REC_HDR + (uint64_t)topk * 8u);
}

#endif /* RW_COMMON_WIRE_REC_H */
