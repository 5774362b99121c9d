// A malloc shim for LD_PRELOAD: the bytes in use (malloc_usable_size) and their peak since the last reset.
// tests/test_workspace.py builds it to see what kernels allocate outside torch's allocator.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <stddef.h>
#include <string.h>
#include <errno.h>

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static long live, peak;
static char boot[1 << 16];
static size_t boot_used;
static int resolving;

static void resolve(void) {
    if (real_malloc || resolving) return;
    resolving = 1;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_free = dlsym(RTLD_NEXT, "free");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    real_memalign = dlsym(RTLD_NEXT, "memalign");
    resolving = 0;
}

static int from_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }

static void *counted(void *p) {
    if (p) {
        long now = __atomic_add_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
        long old = __atomic_load_n(&peak, __ATOMIC_RELAXED);
        while (now > old && !__atomic_compare_exchange_n(&peak, &old, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    return p;
}

void *malloc(size_t n) {
    resolve();
    if (!real_malloc) { void *p = boot + boot_used; boot_used += (n + 15) & ~15UL; return p; }
    return counted(real_malloc(n));
}
void *calloc(size_t a, size_t b) {
    resolve();
    if (!real_calloc) { void *p = boot + boot_used; boot_used += (a * b + 15) & ~15UL; memset(p, 0, a * b); return p; }
    return counted(real_calloc(a, b));
}
void free(void *p) {
    if (!p || from_boot(p)) return;
    resolve();
    __atomic_sub_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
    real_free(p);
}
void *realloc(void *p, size_t n) {
    resolve();
    if (p && from_boot(p)) { void *q = malloc(n); memcpy(q, p, n); return q; }
    if (p) __atomic_sub_fetch(&live, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
    return counted(real_realloc(p, n));
}
int posix_memalign(void **out, size_t align, size_t n) {
    resolve();
    int rc = real_posix_memalign(out, align, n);
    if (rc == 0) counted(*out);
    return rc;
}
void *aligned_alloc(size_t align, size_t n) { resolve(); return counted(real_aligned_alloc(align, n)); }
void *memalign(size_t align, size_t n) { resolve(); return counted(real_memalign(align, n)); }

void mallocpeak_reset(void) { __atomic_store_n(&peak, __atomic_load_n(&live, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
long mallocpeak_live(void) { return __atomic_load_n(&live, __ATOMIC_RELAXED); }
long mallocpeak_peak(void) { return __atomic_load_n(&peak, __ATOMIC_RELAXED); }
