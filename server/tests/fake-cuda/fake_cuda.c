/*
 * A fake CUDA driver (libcuda.so.1) for testing kvtier's GPU tier without a
 * GPU: host memory stands in for device memory. It exports the driver API
 * entry points cudarc's `dynamic-loading` build resolves by name (dlsym) for
 * what the tier calls: init, device query, primary context, cuMemAlloc_v2,
 * pinned host memory, async copies, streams, events, cuMemGetInfo_v2 and the
 * error strings. A test double in the test tree, never a workspace crate
 * (cargo puts target/<profile>/deps on LD_LIBRARY_PATH, where a libcuda.so
 * would shadow the real driver on a GPU machine).
 *
 * Built by server/tests/gpu.rs and by `make fake-cuda` into
 * target/fake-cuda/libcuda.so.1 (+ libcuda.so link). Switches, read once at
 * the first call (environment of the process that loads it):
 *
 *   FAKE_CUDA_DEVICES=N          devices (default 1); 0: cuInit answers
 *                                CUDA_ERROR_NO_DEVICE (100), as on a machine
 *                                with a driver but no GPU
 *   FAKE_CUDA_INIT_ERROR=code    cuInit fails with this CUresult
 *   FAKE_CUDA_MEM_BYTES=n        device memory per device (default 1 GiB);
 *                                cuMemAlloc_v2 past it answers
 *                                CUDA_ERROR_OUT_OF_MEMORY (2)
 *   FAKE_CUDA_RESERVED_BYTES=n   of that memory, n bytes are taken by "another
 *                                process": cuMemGetInfo_v2 reports them used
 *                                and allocations past the rest fail (an
 *                                out-of-memory at run time)
 *   FAKE_CUDA_DEVICE_NAME=s      cuDeviceGetName (default "kvtier fake GPU")
 *   FAKE_CUDA_NOT_READY=N        every recorded event answers
 *                                CUDA_ERROR_NOT_READY (600) to its first N
 *                                cuEventQuery calls
 *   FAKE_CUDA_FAIL_COPY=N        the Nth async copy (1-based, counting both
 *                                directions, or one with FAKE_CUDA_FAIL_KIND)
 *                                fails with CUDA_ERROR_UNKNOWN (999)
 *   FAKE_CUDA_FAIL_EVERY=1       with FAIL_COPY: fail every copy from the
 *                                Nth on, not just the Nth
 *   FAKE_CUDA_CORRUPT_COPY=N     the Nth copy succeeds but flips one byte
 *   FAKE_CUDA_FAIL_KIND=htod|dtoh  which copies FAIL/CORRUPT_COPY count
 *   FAKE_CUDA_DEFERRED=1         copies are queued on their stream and done
 *                                only at a sync point (cuStreamSynchronize,
 *                                cuCtxSynchronize, cuEventSynchronize) or a
 *                                successful cuEventQuery of an event recorded
 *                                after them: a caller that reads before
 *                                waiting reads stale bytes
 *   FAKE_CUDA_TRACE=path         appends one line per call (name and key
 *                                arguments), for tests to check what was
 *                                called; a copy's line says whether its host
 *                                side was page-locked (`host=pinned`: from
 *                                cuMemHostAlloc or cuMemHostRegister_v2) or
 *                                not (`host=pageable`)
 *
 * cuMemHostRegister_v2 checks what the real driver checks of a range: a
 * current context, known flags, every page mapped (/proc/self/maps), no
 * overlap with a registered range (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
 * and, for memory mapped without write permission, the flag
 * CU_MEMHOSTREGISTER_READ_ONLY (else CUDA_ERROR_INVALID_VALUE: the real
 * driver pins pages for writing unless told).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_UNKNOWN = 999,
};

/* cuMemHostRegister flags (cuda.h). */
enum {
    CU_MEMHOSTREGISTER_PORTABLE = 0x01,
    CU_MEMHOSTREGISTER_DEVICEMAP = 0x02,
    CU_MEMHOSTREGISTER_IOMEMORY = 0x04,
    CU_MEMHOSTREGISTER_READ_ONLY = 0x08,
};

struct fake_ctx {
    int device;
    int refs;
};

/* A queued copy (deferred mode). */
struct op {
    void *dst;
    const void *src;
    size_t bytes;
    int corrupt;
    uint64_t seq;
};

struct fake_stream {
    struct op *ops;
    size_t len, cap;
    uint64_t next_seq;
};

struct fake_event {
    struct fake_stream *stream;
    uint64_t seq; /* ops with seq below this precede the event */
    int recorded;
    long not_ready_left;
};

struct alloc {
    CUdeviceptr ptr;
    size_t bytes;
    struct alloc *next;
};

/* Page-locked host memory: cuMemHostAlloc'd (registered 0) or registered. */
struct pinned {
    uintptr_t ptr;
    size_t bytes;
    int registered;
    struct pinned *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int cfg_devices = 1;
static int cfg_init_error;
static size_t cfg_mem_bytes = (size_t)1 << 30;
static size_t cfg_reserved_bytes;
static char cfg_name[128] = "kvtier fake GPU";
static long cfg_not_ready;
static long cfg_fail_copy;
static int cfg_fail_every;
static long cfg_corrupt_copy;
static int cfg_kind; /* 0 both, 1 htod, 2 dtoh */
static int cfg_deferred;
static FILE *trace;

static int initialized;
static struct fake_ctx contexts[16];
static __thread CUcontext current;
static struct alloc *allocs;
static struct pinned *pins;
static size_t used_bytes;
static long copies_counted;
static struct fake_stream null_stream;

static long env_long(const char *name, long dflt) {
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 0) : dflt;
}

static void configure(void) {
    cfg_devices = (int)env_long("FAKE_CUDA_DEVICES", 1);
    if (cfg_devices > 16) cfg_devices = 16;
    cfg_init_error = (int)env_long("FAKE_CUDA_INIT_ERROR", 0);
    const char *mem = getenv("FAKE_CUDA_MEM_BYTES");
    if (mem && *mem) cfg_mem_bytes = strtoull(mem, NULL, 0);
    const char *reserved = getenv("FAKE_CUDA_RESERVED_BYTES");
    if (reserved && *reserved) cfg_reserved_bytes = strtoull(reserved, NULL, 0);
    if (cfg_reserved_bytes > cfg_mem_bytes) cfg_reserved_bytes = cfg_mem_bytes;
    const char *name = getenv("FAKE_CUDA_DEVICE_NAME");
    if (name && *name) snprintf(cfg_name, sizeof cfg_name, "%s", name);
    cfg_not_ready = env_long("FAKE_CUDA_NOT_READY", 0);
    cfg_fail_copy = env_long("FAKE_CUDA_FAIL_COPY", 0);
    cfg_fail_every = (int)env_long("FAKE_CUDA_FAIL_EVERY", 0);
    cfg_corrupt_copy = env_long("FAKE_CUDA_CORRUPT_COPY", 0);
    const char *kind = getenv("FAKE_CUDA_FAIL_KIND");
    cfg_kind = kind && !strcmp(kind, "htod") ? 1 : kind && !strcmp(kind, "dtoh") ? 2 : 0;
    cfg_deferred = (int)env_long("FAKE_CUDA_DEFERRED", 0);
    const char *path = getenv("FAKE_CUDA_TRACE");
    if (path && *path) {
        trace = fopen(path, "a");
        if (trace) setvbuf(trace, NULL, _IOLBF, 0);
    }
}

static void enter(void) {
    pthread_once(&once, configure);
    pthread_mutex_lock(&lock);
}

static CUresult leave(CUresult r) {
    pthread_mutex_unlock(&lock);
    return r;
}

static void say(const char *fmt, ...) {
    if (!trace) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(trace, fmt, ap);
    va_end(ap);
    fputc('\n', trace);
}

static CUresult ready(void) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

static struct alloc *find_alloc(CUdeviceptr p, size_t bytes) {
    for (struct alloc *a = allocs; a; a = a->next)
        if (p >= a->ptr && p + bytes <= a->ptr + a->bytes) return a;
    return NULL;
}

static struct fake_stream *stream_of(CUstream s) { return s ? s : &null_stream; }

/* The page-locked range holding [p, p + bytes), if one does. */
static struct pinned *find_pinned(const void *p, size_t bytes) {
    uintptr_t a = (uintptr_t)p;
    for (struct pinned *x = pins; x; x = x->next)
        if (a >= x->ptr && a + bytes <= x->ptr + x->bytes) return x;
    return NULL;
}

static int add_pinned(const void *p, size_t bytes, int registered) {
    struct pinned *x = malloc(sizeof *x);
    if (!x) return 0;
    x->ptr = (uintptr_t)p;
    x->bytes = bytes;
    x->registered = registered;
    x->next = pins;
    pins = x;
    return 1;
}

/* Removes the range starting at p (registered or not, as asked): 1 if found. */
static int drop_pinned(const void *p, int registered) {
    for (struct pinned **at = &pins; *at; at = &(*at)->next) {
        if ((*at)->ptr == (uintptr_t)p && (*at)->registered == registered) {
            struct pinned *x = *at;
            *at = x->next;
            free(x);
            return 1;
        }
    }
    return 0;
}

/* Whether [p, p + bytes) is wholly mapped (1) and, if so, whether some of it
 * is mapped without write permission (*read_only), from /proc/self/maps. */
static int mapped(uintptr_t p, size_t bytes, int *read_only) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    uintptr_t at = p, end = p + bytes;
    *read_only = 0;
    char line[512];
    /* The lines are sorted by address: walk them, advancing `at`. */
    while (at < end && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
        if (hi <= at) continue;
        if (lo > at) break; /* a hole */
        if (perms[1] != 'w') *read_only = 1;
        at = hi;
    }
    fclose(f);
    return at >= end;
}

/* Performs the queued copies of `s` that precede `seq`. */
static void drain(struct fake_stream *s, uint64_t seq) {
    size_t kept = 0;
    for (size_t i = 0; i < s->len; i++) {
        struct op *o = &s->ops[i];
        if (o->seq < seq) {
            memcpy(o->dst, o->src, o->bytes);
            if (o->corrupt && o->bytes) ((unsigned char *)o->dst)[o->bytes / 2] ^= 0x5a;
        } else {
            s->ops[kept++] = *o;
        }
    }
    s->len = kept;
}

/* One async copy: counted, maybe failed or corrupted, done now or queued. */
static CUresult copy(int kind, void *dst, const void *src, size_t bytes, CUstream hs) {
    struct fake_stream *s = stream_of(hs);
    int counted = cfg_kind == 0 || cfg_kind == kind;
    long n = counted ? ++copies_counted : 0;
    if (counted && cfg_fail_copy && (n == cfg_fail_copy || (cfg_fail_every && n > cfg_fail_copy))) {
        say("%s bytes=%zu FAILED (copy %ld)", kind == 1 ? "cuMemcpyHtoDAsync_v2" : "cuMemcpyDtoHAsync_v2", bytes, n);
        return CUDA_ERROR_UNKNOWN;
    }
    int corrupt = counted && cfg_corrupt_copy && n == cfg_corrupt_copy;
    const void *host = kind == 1 ? src : dst;
    say("%s bytes=%zu host=%s%s", kind == 1 ? "cuMemcpyHtoDAsync_v2" : "cuMemcpyDtoHAsync_v2", bytes,
        find_pinned(host, bytes) ? "pinned" : "pageable", corrupt ? " CORRUPTED" : "");
    struct op o = {dst, src, bytes, corrupt, s->next_seq++};
    if (!cfg_deferred) {
        memcpy(dst, src, bytes);
        if (corrupt && bytes) ((unsigned char *)dst)[bytes / 2] ^= 0x5a;
        return CUDA_SUCCESS;
    }
    if (s->len == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        struct op *ops = realloc(s->ops, cap * sizeof *ops);
        if (!ops) return CUDA_ERROR_OUT_OF_MEMORY;
        s->ops = ops;
        s->cap = cap;
    }
    s->ops[s->len++] = o;
    return CUDA_SUCCESS;
}

/* ---- errors ---- */

CUresult cuGetErrorString(CUresult error, const char **p) {
    pthread_once(&once, configure);
    switch (error) {
    case CUDA_SUCCESS: *p = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *p = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *p = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *p = "initialization error"; break;
    case CUDA_ERROR_NO_DEVICE: *p = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_INVALID_DEVICE: *p = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *p = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: *p = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_READY: *p = "device not ready"; break;
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: *p = "part or all of the requested memory range is already mapped"; break;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: *p = "pointer does not correspond to a registered memory region"; break;
    case 35: *p = "CUDA driver version is insufficient for CUDA runtime version"; break;
    default: *p = "unknown error"; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **p) {
    switch (error) {
    case CUDA_SUCCESS: *p = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *p = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NO_DEVICE: *p = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_NOT_READY: *p = "CUDA_ERROR_NOT_READY"; break;
    case CUDA_ERROR_INVALID_VALUE: *p = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *p = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: *p = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; break;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: *p = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
    default: *p = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}

/* ---- init and devices ---- */

CUresult cuInit(unsigned flags) {
    (void)flags;
    enter();
    say("cuInit");
    if (cfg_init_error) return leave(cfg_init_error);
    if (cfg_devices <= 0) return leave(CUDA_ERROR_NO_DEVICE);
    initialized = 1;
    return leave(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *v) {
    *v = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    *count = cfg_devices;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    enter();
    say("cuDeviceGet %d", ordinal);
    CUresult r = ready();
    if (r) return leave(r);
    if (ordinal < 0 || ordinal >= cfg_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    *dev = ordinal;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (dev < 0 || dev >= cfg_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "%s", cfg_name);
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (dev < 0 || dev >= cfg_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    *bytes = cfg_mem_bytes;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (dev < 0 || dev >= cfg_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    switch (attrib) {
    case 75: *value = 9; break;  /* compute capability major */
    case 76: *value = 0; break;  /* minor */
    case 115: *value = 1; break; /* memory pools supported, as on an H100 */
    default: *value = 0; break;
    }
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice dev) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    memset(uuid, 0, 16);
    uuid[0] = (unsigned char)dev;
    return leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

/* ---- contexts ---- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    enter();
    say("cuDevicePrimaryCtxRetain %d", dev);
    CUresult r = ready();
    if (r) return leave(r);
    if (dev < 0 || dev >= cfg_devices) return leave(CUDA_ERROR_INVALID_DEVICE);
    contexts[dev].device = dev;
    contexts[dev].refs++;
    *ctx = &contexts[dev];
    return leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    enter();
    say("cuDevicePrimaryCtxRelease_v2 %d", dev);
    if (dev < 0 || dev >= cfg_devices || contexts[dev].refs <= 0) return leave(CUDA_ERROR_INVALID_CONTEXT);
    contexts[dev].refs--;
    return leave(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    *ctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    enter();
    say("cuCtxSynchronize");
    drain(&null_stream, UINT64_MAX);
    return leave(CUDA_SUCCESS);
}

/* ---- memory ---- */

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (!current) return leave(CUDA_ERROR_INVALID_CONTEXT);
    if (bytes == 0) return leave(CUDA_ERROR_INVALID_VALUE);
    if (bytes > cfg_mem_bytes - cfg_reserved_bytes - used_bytes) {
        say("cuMemAlloc_v2 bytes=%zu OUT_OF_MEMORY", bytes);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    void *mem = malloc(bytes);
    struct alloc *a = malloc(sizeof *a);
    if (!mem || !a) {
        free(mem);
        free(a);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    a->ptr = (CUdeviceptr)(uintptr_t)mem;
    a->bytes = bytes;
    a->next = allocs;
    allocs = a;
    used_bytes += bytes;
    *p = a->ptr;
    say("cuMemAlloc_v2 bytes=%zu", bytes);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    enter();
    say("cuMemFree_v2");
    for (struct alloc **at = &allocs; *at; at = &(*at)->next) {
        if ((*at)->ptr == p) {
            struct alloc *a = *at;
            *at = a->next;
            used_bytes -= a->bytes;
            free((void *)(uintptr_t)a->ptr);
            free(a);
            return leave(CUDA_SUCCESS);
        }
    }
    return leave(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    *free_bytes = cfg_mem_bytes - cfg_reserved_bytes - used_bytes;
    *total = cfg_mem_bytes;
    return leave(CUDA_SUCCESS);
}

CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
    enter();
    say("cuMemHostAlloc bytes=%zu flags=%u", bytes, flags);
    CUresult r = ready();
    if (r) return leave(r);
    *p = malloc(bytes ? bytes : 1);
    if (*p && !add_pinned(*p, bytes ? bytes : 1, 0)) {
        free(*p);
        *p = NULL;
    }
    return leave(*p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

CUresult cuMemFreeHost(void *p) {
    enter();
    say("cuMemFreeHost");
    drop_pinned(p, 0);
    free(p);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (!current) return leave(CUDA_ERROR_INVALID_CONTEXT);
    unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                     CU_MEMHOSTREGISTER_READ_ONLY;
    int read_only = 0;
    if (!p || bytes == 0 || (flags & ~known) || !mapped((uintptr_t)p, bytes, &read_only)) {
        say("cuMemHostRegister_v2 bytes=%zu flags=%u INVALID_VALUE", bytes, flags);
        return leave(CUDA_ERROR_INVALID_VALUE);
    }
    if (read_only && !(flags & CU_MEMHOSTREGISTER_READ_ONLY)) {
        say("cuMemHostRegister_v2 bytes=%zu flags=%u INVALID_VALUE (read-only memory without READ_ONLY)", bytes, flags);
        return leave(CUDA_ERROR_INVALID_VALUE);
    }
    uintptr_t a = (uintptr_t)p;
    for (struct pinned *x = pins; x; x = x->next) {
        if (a < x->ptr + x->bytes && x->ptr < a + bytes) {
            say("cuMemHostRegister_v2 bytes=%zu flags=%u ALREADY_REGISTERED", bytes, flags);
            return leave(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
    }
    if (!add_pinned(p, bytes, 1)) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    say("cuMemHostRegister_v2 bytes=%zu flags=%u", bytes, flags);
    return leave(CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void *p) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (!drop_pinned(p, 1)) {
        say("cuMemHostUnregister NOT_REGISTERED");
        return leave(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    }
    say("cuMemHostUnregister");
    return leave(CUDA_SUCCESS);
}

/* ---- copies ---- */

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (!find_alloc(dst, bytes)) return leave(CUDA_ERROR_INVALID_VALUE);
    return leave(copy(1, (void *)(uintptr_t)dst, src, bytes, s));
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream s) {
    enter();
    CUresult r = ready();
    if (r) return leave(r);
    if (!find_alloc(src, bytes)) return leave(CUDA_ERROR_INVALID_VALUE);
    return leave(copy(2, dst, (const void *)(uintptr_t)src, bytes, s));
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    CUresult r = cuMemcpyHtoDAsync_v2(dst, src, bytes, NULL);
    if (r) return r;
    return cuCtxSynchronize();
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    CUresult r = cuMemcpyDtoHAsync_v2(dst, src, bytes, NULL);
    if (r) return r;
    return cuCtxSynchronize();
}

/* ---- streams ---- */

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    enter();
    say("cuStreamCreate flags=%u", flags);
    CUresult r = ready();
    if (r) return leave(r);
    *s = calloc(1, sizeof **s);
    return leave(*s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

CUresult cuStreamDestroy_v2(CUstream s) {
    enter();
    say("cuStreamDestroy_v2");
    if (!s) return leave(CUDA_ERROR_INVALID_HANDLE);
    drain(s, UINT64_MAX);
    free(s->ops);
    free(s);
    return leave(CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream s) {
    enter();
    say("cuStreamSynchronize");
    drain(stream_of(s), UINT64_MAX);
    return leave(CUDA_SUCCESS);
}

/* ---- events ---- */

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    enter();
    say("cuEventCreate flags=%u", flags);
    CUresult r = ready();
    if (r) return leave(r);
    *e = calloc(1, sizeof **e);
    return leave(*e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

CUresult cuEventDestroy_v2(CUevent e) {
    enter();
    say("cuEventDestroy_v2");
    free(e);
    return leave(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent e, CUstream hs) {
    enter();
    if (!e) return leave(CUDA_ERROR_INVALID_HANDLE);
    struct fake_stream *s = stream_of(hs);
    e->stream = s;
    e->seq = s->next_seq;
    e->recorded = 1;
    e->not_ready_left = cfg_not_ready;
    return leave(CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent e) {
    enter();
    if (!e) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (!e->recorded) return leave(CUDA_SUCCESS);
    if (e->not_ready_left > 0) {
        e->not_ready_left--;
        say("cuEventQuery NOT_READY");
        return leave(CUDA_ERROR_NOT_READY);
    }
    drain(e->stream, e->seq);
    say("cuEventQuery SUCCESS");
    return leave(CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent e) {
    enter();
    say("cuEventSynchronize");
    if (!e) return leave(CUDA_ERROR_INVALID_HANDLE);
    if (e->recorded) drain(e->stream, e->seq);
    e->not_ready_left = 0;
    return leave(CUDA_SUCCESS);
}
