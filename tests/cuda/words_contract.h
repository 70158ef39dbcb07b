/* tests/cuda/words_contract.h: the contract of the rank path's words (cuda/words.c,
 * docs/rankpath.md "The rank page") as cases that run the same on the stand-in driver
 * (test/cuda_fake) and on a GPU (test/cuda), so the stand-in is held to what the driver does. */
#ifndef RW_TESTS_WORDS_CONTRACT_H
#define RW_TESTS_WORDS_CONTRACT_H

/* Each asserts with cmocka; the driver must be initialised and device 0 usable. */
void rw_words_case_wait_holds_its_stream_only(void);
void rw_words_case_cyclic_geq_and_owed_words(void);
void rw_words_case_bad_addresses(void);

#endif /* RW_TESTS_WORDS_CONTRACT_H */
