/* tests/cuda/vmm_contract.h: the contract of GPU memory lent by fd (cuda/vmm.c, the groups' GPU
 * slabs: docs/rankpath.md "The slab areas, lent per group") as cases that run the same on the
 * stand-in driver (test/cuda_fake) and on a GPU (test/cuda), so the stand-in is held to what the
 * driver does. */
#ifndef RW_TESTS_VMM_CONTRACT_H
#define RW_TESTS_VMM_CONTRACT_H

/* Each asserts with cmocka; the driver must be initialised and device 0 make such memory. */
void rw_vmm_case_export_import_same_memory(void);
void rw_vmm_case_refusals(void);
/* The daemon's header pull (cuda/pull.c) out of such memory: strided rows land in page-locked
 * host memory, nothing between them, and the mark's word says when (numbered 1, 2, ...). */
void rw_vmm_case_pull_rows(void);

#endif /* RW_TESTS_VMM_CONTRACT_H */
