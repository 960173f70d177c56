/* Large copies with non-temporal (streaming) stores, for streamrover.ckpt.copier.
 *
 * A snapshot copy moves hundreds of MiB that nobody reads again soon from this core's caches. A plain
 * memcpy first reads every destination cache line into the cache (read-for-ownership) and then writes it
 * back: three memory transfers per line. Streaming stores write whole lines straight to memory: two
 * transfers, and the caches keep the trainer's working set. On the 2-core VMs we measure on, 1 GiB copies
 * in 0.046 s with glibc memcpy on 2 threads and 0.037 s with this (0.055 and 0.046 s on one thread).
 *
 * Plain C with no Python API: the package loads it with ctypes (which releases the GIL for the call). It is
 * built by the package install when a C compiler is there; without it the copier falls back to memmove.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copy n bytes from src to dst (the ranges must not overlap). */
void streamrover_copy_nt(void *dst_, const void *src_, size_t n) {
    char *dst = (char *)dst_;
    const char *src = (const char *)src_;
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte aligned addresses */
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* the streamed lines are visible to other cores before the caller publishes them */
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}
