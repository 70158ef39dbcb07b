/* rw_put_le / rw_get_le (common/common.h): the byte order every wire format promises, at every
 * width and at unaligned addresses, independent of the host's order. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <string.h>
#include <cmocka.h>

#include "common/common.h"

static void test_byte_order(void **state)
{
	(void)state;
	static const uint8_t want[8] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11};
	const uint64_t v = 0x1122334455667788ull;
	uint8_t buf[16];
	for (unsigned width = 1; width <= 8; width++) {
		for (unsigned off = 0; off < 8; off++) { /* every alignment */
			memset(buf, 0xa5, sizeof(buf));
			rw_put_le(buf + off, v, width);
			assert_memory_equal(buf + off, want, width); /* low byte first */
			for (unsigned i = 0; i < sizeof(buf); i++)   /* nothing else written */
				if (i < off || i >= off + width)
					assert_int_equal(buf[i], 0xa5);
			uint64_t low = width == 8 ? v : v & ((1ull << (8 * width)) - 1);
			assert_true(rw_get_le(buf + off, width) == low);
		}
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_byte_order),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
