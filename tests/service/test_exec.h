/* svc_exec's case families (tests/service/test_exec_*.c), each a cmocka group run by
 * tests/service/test_exec.c's main; every case uses the harness of exec_harness.h. */
#ifndef RW_TEST_EXEC_H
#define RW_TEST_EXEC_H

#include "tests/service/exec_harness.h"

int exec_paths_run(void);     /* svc_exec_paths */
int exec_failures_run(void);  /* svc_exec_failures */
int exec_bad_input_run(void); /* svc_exec_bad_input */
int exec_leave_run(void);     /* svc_exec_leave */
int exec_groups_run(void);    /* svc_exec_groups */
int exec_gpu_run(void);       /* svc_exec_gpu */
int exec_bugs_run(void);      /* svc_exec_fixed_bugs */

#endif /* RW_TEST_EXEC_H */
