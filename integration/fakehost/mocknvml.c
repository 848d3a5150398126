/*
 * mocknvml.c - a stand-in for NVIDIA's libnvidia-ml.so.1 on the simulated
 * GPU host that integration/fakehost builds.
 *
 * There is no GPU (and no NVIDIA kernel module) where gpuhook's tests run, so
 * this library answers the handful of NVML calls gpuhook makes from a text
 * file instead.  It is built into
 *     <root>/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.<driver version>
 * with SONAME libnvidia-ml.so.1, and it finds its answers in
 *     <root>/etc/mock-nvml/topology
 * where <root> is the directory three levels above the library's own
 * directory (found with dladdr), so one build serves any host directory.
 *
 * The ABI (function signatures, struct layouts, error codes, version
 * encodings) follows nvml.h as used by pynvml (nvidia-ml-py 13).
 *
 * Topology format (line based; '#' comments and blank lines are ignored):
 *     mock-nvml-topology 1
 *     driver <driver version>                     e.g. 550.54.15
 *     nvml <NVML version string>                  e.g. 12.550.54.15
 *     cuda <CUDA driver version as NVML encodes>  e.g. 12040 for 12.4
 *     gpu <index> <minor> <uuid> <bus id> <pci device id> <pci subsystem id>
 *         <cc major>.<cc minor> <memory bytes> <brand> <mig> <persistence>
 *         <name, rest of the line>
 *     mig <gpu index> <index on the gpu> <gpu instance id> <compute instance id>
 *         <uuid> <memory bytes> <name, rest of the line>
 * (each record is one line).  <mig> is "none" (MIG not supported), "disabled"
 * or "enabled"; <persistence> is 0 or 1; ids are hex with a 0x prefix.  A mig
 * record is one MIG device of an "enabled" GPU listed before it; a GPU's MIG
 * devices come in creation order, which is their index on the GPU.
 *
 * MIG: a MIG device handle answers the calls NVML documents for MIG devices
 * (UUID, name, memory, ids, parent); GPU-only queries (index, minor number,
 * PCI info, persistence and MIG mode) are NVML_ERROR_NOT_SUPPORTED on it.
 * Handing a MIG call the wrong kind of handle (a GPU where a MIG device is
 * expected, or the reverse) is NVML_ERROR_INVALID_ARGUMENT.
 *
 * Call counting: every exported function counts one call.  When the last
 * nvmlShutdown() balances the inits (and, for calls never logged, when the
 * library is unloaded or the process exits) the library appends
 * "<pid> <calls since this process's previous line>\n" to
 *     <root>/etc/mock-nvml/calls.log
 * if that file exists.  A process that never calls NVML writes nothing, so an
 * unchanged calls.log proves that no NVML call was made.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Only the NVML entry points are exported; helpers stay hidden
 * (the library is built with -fvisibility=hidden). */
#define NVML_EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI (values and layouts as in nvml.h / pynvml.py) ------------ */

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef enum {
    NVML_FEATURE_DISABLED = 0,
    NVML_FEATURE_ENABLED = 1
} nvmlEnableState_t;

/* nvmlBrandType_t is a C enum, i.e. int-sized; the values come from the
 * topology file (NVML_BRAND_TESLA is 2, NVML_BRAND_NVIDIA is 14). */
typedef unsigned int nvmlBrandType_t;

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

/* nvmlPciInfo_t as filled by nvmlDeviceGetPciInfo_v3. */
typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;    /* (device id << 16) | vendor id */
    unsigned int pciSubSystemId; /* (subsystem id << 16) | subsystem vendor */
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* NVML_STRUCT_VERSION(Memory, 2): sizeof the struct | (2 << 24). */
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* ---- simulated devices ------------------------------------------------- */

#define MOCK_MAX_GPUS 64
#define MOCK_MIG_NONE (-1)
#define MOCK_MIG_DISABLED 0
#define MOCK_MIG_ENABLED 1
/* nvmlDeviceGetMaxMigDeviceCount of a MIG-enabled GPU: one per compute slice. */
#define MOCK_MAX_MIG_PER_GPU 7
#define MOCK_MAX_MIGS (MOCK_MAX_GPUS * MOCK_MAX_MIG_PER_GPU)
#define MOCK_MAX_GPU_INSTANCE_ID 14
#define MOCK_MAX_COMPUTE_INSTANCE_ID 7

/* The opaque nvmlDevice_t points at one of these. */
struct nvmlDevice_st {
    unsigned int index;
    unsigned int minor;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pci_device_id;
    unsigned int pci_subsystem_id;
    int cc_major;
    int cc_minor;
    unsigned long long memory_total;
    nvmlBrandType_t brand;
    int mig_mode;
    nvmlEnableState_t persistence;
    /* Health, from an optional "health" record: retired pages pending, row remapping pending/failed. */
    unsigned int retired_pending;
    unsigned int remap_pending;
    unsigned int remap_failure;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    /* A MIG device: its GPU (index into devices) and instance ids. */
    int is_mig;
    unsigned int parent;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
    /* A GPU: its MIG devices (indices into migs), in creation order. */
    unsigned int mig_count;
    unsigned int migs[MOCK_MAX_MIG_PER_GPU];
};
typedef struct nvmlDevice_st *nvmlDevice_t;

struct topology {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int cuda_version;
    unsigned int count;
    struct nvmlDevice_st devices[MOCK_MAX_GPUS];
    unsigned int mig_total;
    struct nvmlDevice_st migs[MOCK_MAX_MIGS];
};

/* Init/shutdown and topology (re)loading happen under g_lock.  Readers only
 * check g_refcount: the topology is rewritten solely on a 0 -> 1 init, when
 * no caller may legitimately hold a handle. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint g_refcount;
static struct topology g_topo;

/* Calls made and calls already written to calls.log (atomics: NVML is
 * called from many threads and the count must stay exact). */
static atomic_ulong g_calls;
static atomic_ulong g_logged;
static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;

#define COUNT_CALL() atomic_fetch_add_explicit(&g_calls, 1, memory_order_relaxed)

/* ---- locating the host root -------------------------------------------- */

static pthread_once_t g_paths_once = PTHREAD_ONCE_INIT;
static char g_topology_path[PATH_MAX];
static char g_calls_log_path[PATH_MAX];

/* dst = root + rel, or "" when that would not fit. */
static void join_path(char *dst, size_t size, const char *root, const char *rel)
{
    int len = snprintf(dst, size, "%s%s", root, rel);
    if (len < 0 || (size_t)len >= size)
        dst[0] = '\0';
}

/* Strips the library's file name and three directories from its real path;
 * "" stands for "/" so the paths below can be built by concatenation. */
static void compute_paths(void)
{
    Dl_info info;
    char real[PATH_MAX];

    /* Without a usable path both stay "" and every init fails cleanly. */
    if (dladdr((void *)&compute_paths, &info) == 0 || info.dli_fname == NULL)
        return;
    if (realpath(info.dli_fname, real) == NULL)
        return;
    for (int up = 0; up < 4; up++) {
        char *slash = strrchr(real, '/');
        if (slash == NULL)
            return;
        *slash = '\0';
    }
    join_path(g_topology_path, sizeof g_topology_path, real, "/etc/mock-nvml/topology");
    join_path(g_calls_log_path, sizeof g_calls_log_path, real, "/etc/mock-nvml/calls.log");
}

static void ensure_paths(void)
{
    pthread_once(&g_paths_once, compute_paths);
}

/* ---- call log ------------------------------------------------------------ */

/* Appends the calls not yet logged, in a single write(2) so that lines from
 * concurrent processes (O_APPEND) never interleave. */
static void flush_call_log(void)
{
    pthread_mutex_lock(&g_log_lock);
    unsigned long calls = atomic_load(&g_calls);
    unsigned long pending = calls - atomic_load(&g_logged);
    if (pending != 0) {
        ensure_paths();
        /* No O_CREAT: the log is opt-in, fakehost creates it. */
        int fd = g_calls_log_path[0] ? open(g_calls_log_path, O_WRONLY | O_APPEND | O_CLOEXEC) : -1;
        if (fd >= 0) {
            char line[64];
            int len = snprintf(line, sizeof line, "%ld %lu\n", (long)getpid(), pending);
            if (len > 0 && write(fd, line, (size_t)len) != len)
                fprintf(stderr, "mock-nvml: short write to %s\n", g_calls_log_path);
            close(fd);
        }
        atomic_store(&g_logged, calls);
    }
    pthread_mutex_unlock(&g_log_lock);
}

/* A forked child starts its own count: its calls are its own pid's. */
static void reset_counts_in_child(void)
{
    atomic_store(&g_calls, 0);
    atomic_store(&g_logged, 0);
}

__attribute__((constructor)) static void mock_nvml_load(void)
{
    pthread_atfork(NULL, NULL, reset_counts_in_child);
}

/* Processes that never call nvmlShutdown() still leave their line. */
__attribute__((destructor)) static void mock_nvml_unload(void)
{
    flush_call_log();
}

/* ---- topology parsing ---------------------------------------------------- */

static nvmlReturn_t topology_error(unsigned int lineno, const char *why)
{
    fprintf(stderr, "mock-nvml: %s:%u: %s\n", g_topology_path, lineno, why);
    return NVML_ERROR_UNKNOWN;
}

/* Copies src into a fixed buffer; fails rather than truncating. */
static int copy_field(char *dst, size_t size, const char *src)
{
    size_t len = strlen(src);
    if (len == 0 || len >= size)
        return -1;
    memcpy(dst, src, len + 1);
    return 0;
}

/* Parses one "gpu ..." record into the next free device slot. */
static nvmlReturn_t parse_gpu(struct topology *topo, char *line, unsigned int lineno)
{
    struct nvmlDevice_st dev;
    char mig[16];
    unsigned int function;
    unsigned int persistence;
    int name_at = -1;

    memset(&dev, 0, sizeof dev);
    if (topo->count >= MOCK_MAX_GPUS)
        return topology_error(lineno, "too many gpu records");
    int fields = sscanf(line, "gpu %u %u %95s %31s %x %x %d.%d %llu %u %15s %u %n", &dev.index,
                        &dev.minor, dev.uuid, dev.bus_id, &dev.pci_device_id,
                        &dev.pci_subsystem_id, &dev.cc_major, &dev.cc_minor, &dev.memory_total,
                        &dev.brand, mig, &persistence, &name_at);
    if (fields != 12 || name_at < 0)
        return topology_error(lineno, "malformed gpu record");
    if (dev.index != topo->count)
        return topology_error(lineno, "gpu records must be in index order 0, 1, ...");
    if (persistence > 1)
        return topology_error(lineno, "persistence must be 0 or 1");
    dev.persistence = persistence ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    if (strcmp(mig, "none") == 0)
        dev.mig_mode = MOCK_MIG_NONE;
    else if (strcmp(mig, "disabled") == 0)
        dev.mig_mode = MOCK_MIG_DISABLED;
    else if (strcmp(mig, "enabled") == 0)
        dev.mig_mode = MOCK_MIG_ENABLED;
    else
        return topology_error(lineno, "mig must be 'none', 'disabled' or 'enabled'");
    if (sscanf(dev.bus_id, "%x:%x:%x.%x", &dev.domain, &dev.bus, &dev.device, &function) != 4)
        return topology_error(lineno, "bad PCI bus id");
    if (copy_field(dev.name, sizeof dev.name, line + name_at) != 0)
        return topology_error(lineno, "missing or overlong gpu name");
    topo->devices[topo->count++] = dev;
    return NVML_SUCCESS;
}

/* Parses one "health <gpu-index> <retired-pending> <remap-pending> <remap-failure>" record (0/1 each). */
static nvmlReturn_t parse_health(struct topology *topo, char *line, unsigned int lineno)
{
    unsigned int gpu, retired, pending, failure;
    if (sscanf(line, "health %u %u %u %u", &gpu, &retired, &pending, &failure) != 4)
        return topology_error(lineno, "malformed health record");
    if (gpu >= topo->count)
        return topology_error(lineno, "health record for an unknown gpu");
    if (retired > 1 || pending > 1 || failure > 1)
        return topology_error(lineno, "health flags must be 0 or 1");
    topo->devices[gpu].retired_pending = retired;
    topo->devices[gpu].remap_pending = pending;
    topo->devices[gpu].remap_failure = failure;
    return NVML_SUCCESS;
}

/* Parses one "mig ..." record: a MIG device of an already listed GPU. */
static nvmlReturn_t parse_mig(struct topology *topo, char *line, unsigned int lineno)
{
    struct nvmlDevice_st dev;
    unsigned int gpu;
    unsigned int position;
    int name_at = -1;

    memset(&dev, 0, sizeof dev);
    int fields = sscanf(line, "mig %u %u %u %u %95s %llu %n", &gpu, &position, &dev.gpu_instance_id,
                        &dev.compute_instance_id, dev.uuid, &dev.memory_total, &name_at);
    if (fields != 6 || name_at < 0)
        return topology_error(lineno, "malformed mig record");
    if (gpu >= topo->count)
        return topology_error(lineno, "mig record before its gpu record");
    struct nvmlDevice_st *parent = &topo->devices[gpu];
    if (parent->mig_mode != MOCK_MIG_ENABLED)
        return topology_error(lineno, "mig record for a gpu whose MIG mode is not enabled");
    if (position != parent->mig_count || position >= MOCK_MAX_MIG_PER_GPU)
        return topology_error(lineno, "a gpu's mig records must be numbered 0, 1, ... (at most 7)");
    if (dev.gpu_instance_id > MOCK_MAX_GPU_INSTANCE_ID ||
        dev.compute_instance_id > MOCK_MAX_COMPUTE_INSTANCE_ID)
        return topology_error(lineno, "gpu instance id must be 0-14, compute instance id 0-7");
    if (strncmp(dev.uuid, "MIG-", 4) != 0)
        return topology_error(lineno, "a MIG device uuid starts with MIG-");
    for (unsigned int i = 0; i < parent->mig_count; i++) {
        const struct nvmlDevice_st *other = &topo->migs[parent->migs[i]];
        if (other->gpu_instance_id == dev.gpu_instance_id &&
            other->compute_instance_id == dev.compute_instance_id)
            return topology_error(lineno, "duplicate gpu/compute instance ids on one gpu");
    }
    if (copy_field(dev.name, sizeof dev.name, line + name_at) != 0)
        return topology_error(lineno, "missing or overlong mig device name");
    /* Cannot overflow: each of at most MOCK_MAX_GPUS gpus has at most
     * MOCK_MAX_MIG_PER_GPU MIG devices. */
    dev.is_mig = 1;
    dev.parent = gpu;
    dev.index = position;
    dev.minor = parent->minor;
    dev.cc_major = parent->cc_major;
    dev.cc_minor = parent->cc_minor;
    dev.brand = parent->brand;
    dev.mig_mode = MOCK_MIG_NONE;
    dev.persistence = parent->persistence;
    parent->migs[parent->mig_count++] = topo->mig_total;
    topo->migs[topo->mig_total++] = dev;
    return NVML_SUCCESS;
}

/* Parses one line; the line has had its newline and trailing blanks removed. */
static nvmlReturn_t parse_line(struct topology *topo, char *line, unsigned int lineno, int *saw_header)
{
    char value[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    unsigned int format;

    if (line[0] == '\0' || line[0] == '#')
        return NVML_SUCCESS;
    if (!*saw_header) {
        if (sscanf(line, "mock-nvml-topology %u", &format) != 1 || format != 1)
            return topology_error(lineno, "expected 'mock-nvml-topology 1' first");
        *saw_header = 1;
        return NVML_SUCCESS;
    }
    if (strncmp(line, "gpu ", 4) == 0)
        return parse_gpu(topo, line, lineno);
    if (strncmp(line, "mig ", 4) == 0)
        return parse_mig(topo, line, lineno);
    if (strncmp(line, "health ", 7) == 0)
        return parse_health(topo, line, lineno);
    if (sscanf(line, "driver %79s", value) == 1)
        return copy_field(topo->driver_version, sizeof topo->driver_version, value) == 0
                   ? NVML_SUCCESS
                   : topology_error(lineno, "bad driver version");
    if (sscanf(line, "nvml %79s", value) == 1)
        return copy_field(topo->nvml_version, sizeof topo->nvml_version, value) == 0
                   ? NVML_SUCCESS
                   : topology_error(lineno, "bad NVML version");
    if (sscanf(line, "cuda %d", &topo->cuda_version) == 1)
        return NVML_SUCCESS;
    return topology_error(lineno, "unknown record");
}

/* Reads the whole topology file into *topo. */
static nvmlReturn_t load_topology(struct topology *topo)
{
    char line[512];
    unsigned int lineno = 0;
    int saw_header = 0;
    nvmlReturn_t ret = NVML_SUCCESS;

    ensure_paths();
    memset(topo, 0, sizeof *topo);
    /* No topology means no driver, which real NVML reports the same way. */
    FILE *file = g_topology_path[0] ? fopen(g_topology_path, "re") : NULL;
    if (file == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    while (ret == NVML_SUCCESS && fgets(line, sizeof line, file) != NULL) {
        size_t len = strlen(line);
        lineno++;
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            ret = topology_error(lineno, "line too long");
            break;
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == ' ' || line[len - 1] == '\t'))
            line[--len] = '\0';
        ret = parse_line(topo, line, lineno, &saw_header);
    }
    fclose(file);
    if (ret == NVML_SUCCESS && (!saw_header || topo->driver_version[0] == '\0' ||
                                topo->nvml_version[0] == '\0' || topo->cuda_version <= 0))
        ret = topology_error(lineno, "missing header, driver, nvml or cuda record");
    return ret;
}

/* ---- helpers for the entry points --------------------------------------- */

static int initialized(void)
{
    return atomic_load(&g_refcount) > 0;
}

/* Whether device points at one of the first count entries of table. */
static int in_table(nvmlDevice_t device, const struct nvmlDevice_st *table, unsigned int count)
{
    uintptr_t base = (uintptr_t)&table[0];
    uintptr_t ptr = (uintptr_t)device;
    if (device == NULL || ptr < base)
        return 0;
    uintptr_t offset = ptr - base;
    return offset % sizeof(struct nvmlDevice_st) == 0 && offset / sizeof(struct nvmlDevice_st) < count;
}

/* Checks that a handle is one this library handed out: a GPU or a MIG device. */
static int valid_device(nvmlDevice_t device)
{
    return in_table(device, g_topo.devices, g_topo.count) || in_table(device, g_topo.migs, g_topo.mig_total);
}

/* Common prologue for device queries: initialised, known handle, out pointer. */
static nvmlReturn_t check_device(nvmlDevice_t device, const void *out)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_device(device) || out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

/* For queries about a physical GPU only: a MIG device handle is not supported. */
static nvmlReturn_t check_gpu(nvmlDevice_t device, const void *out)
{
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && device->is_mig)
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

/* For MIG calls that take one kind of handle: the other kind is invalid. */
static nvmlReturn_t check_kind(nvmlDevice_t device, const void *out, int want_mig)
{
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && device->is_mig != want_mig)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    return ret;
}

/* NVML's string contract: NULL is invalid, a short buffer is reported. */
static nvmlReturn_t copy_out(char *buffer, unsigned int length, const char *value)
{
    size_t needed = strlen(value) + 1;
    if (buffer == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (length < needed)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buffer, value, needed);
    return NVML_SUCCESS;
}

/* ---- initialisation ----------------------------------------------------- */

static nvmlReturn_t init_common(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;

    pthread_mutex_lock(&g_lock);
    if (atomic_load(&g_refcount) == 0)
        ret = load_topology(&g_topo);
    if (ret == NVML_SUCCESS)
        atomic_fetch_add(&g_refcount, 1);
    pthread_mutex_unlock(&g_lock);
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    COUNT_CALL();
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing for a simulated host. */
    return init_common();
}

NVML_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    COUNT_CALL();
    return init_common();
}

/* The unversioned symbol that pre-v2 binaries link against. */
NVML_EXPORT nvmlReturn_t nvmlInit(void)
{
    COUNT_CALL();
    return init_common();
}

NVML_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    int last = 0;

    COUNT_CALL();
    pthread_mutex_lock(&g_lock);
    unsigned int refs = atomic_load(&g_refcount);
    if (refs > 0) {
        atomic_store(&g_refcount, refs - 1);
        last = refs == 1;
    }
    pthread_mutex_unlock(&g_lock);
    if (refs == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (last)
        flush_call_log();
    return NVML_SUCCESS;
}

NVML_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    COUNT_CALL();
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- system queries ------------------------------------------------------ */

NVML_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    COUNT_CALL();
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_out(version, length, g_topo.driver_version);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    COUNT_CALL();
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_out(version, length, g_topo.nvml_version);
}

static nvmlReturn_t cuda_driver_version(int *cudaDriverVersion)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = g_topo.cuda_version;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    COUNT_CALL();
    return cuda_driver_version(cudaDriverVersion);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    COUNT_CALL();
    return cuda_driver_version(cudaDriverVersion);
}

/* ---- device enumeration ------------------------------------------------- */

static nvmlReturn_t device_count(unsigned int *deviceCount)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = g_topo.count;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    COUNT_CALL();
    return device_count(deviceCount);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    COUNT_CALL();
    return device_count(deviceCount);
}

static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= g_topo.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_topo.devices[index];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    COUNT_CALL();
    return handle_by_index(index, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    COUNT_CALL();
    return handle_by_index(index, device);
}

/* The pre-R470 MIG device name, MIG-<GPU uuid>/<gpu instance>/<compute
 * instance>, which NVML still resolves. */
static nvmlReturn_t mig_by_legacy_uuid(const char *uuid, nvmlDevice_t *device)
{
    char parent_uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    unsigned int gi;
    unsigned int ci;
    char extra;

    if (strncmp(uuid, "MIG-GPU-", 8) != 0)
        return NVML_ERROR_NOT_FOUND;
    const char *slash = strchr(uuid + 4, '/');
    size_t len = slash == NULL ? 0 : (size_t)(slash - (uuid + 4));
    if (len == 0 || len >= sizeof parent_uuid || sscanf(slash, "/%u/%u%c", &gi, &ci, &extra) != 2)
        return NVML_ERROR_NOT_FOUND;
    memcpy(parent_uuid, uuid + 4, len);
    parent_uuid[len] = '\0';
    for (unsigned int i = 0; i < g_topo.mig_total; i++) {
        struct nvmlDevice_st *mig = &g_topo.migs[i];
        if (mig->gpu_instance_id == gi && mig->compute_instance_id == ci &&
            strcmp(g_topo.devices[mig->parent].uuid, parent_uuid) == 0) {
            *device = mig;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    COUNT_CALL();
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_topo.count; i++) {
        if (strcmp(g_topo.devices[i].uuid, uuid) == 0) {
            *device = &g_topo.devices[i];
            return NVML_SUCCESS;
        }
    }
    for (unsigned int i = 0; i < g_topo.mig_total; i++) {
        if (strcmp(g_topo.migs[i].uuid, uuid) == 0) {
            *device = &g_topo.migs[i];
            return NVML_SUCCESS;
        }
    }
    return mig_by_legacy_uuid(uuid, device);
}

/* ---- device queries ------------------------------------------------------ */

NVML_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, index);
    if (ret == NVML_SUCCESS)
        *index = device->index;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, uuid);
    return ret == NVML_SUCCESS ? copy_out(uuid, length, device->uuid) : ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, name);
    return ret == NVML_SUCCESS ? copy_out(name, length, device->name) : ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, minorNumber);
    if (ret == NVML_SUCCESS)
        *minorNumber = device->minor;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, pci);
    if (ret != NVML_SUCCESS)
        return ret;
    memset(pci, 0, sizeof *pci);
    /* The legacy field holds the 4-digit-domain form, as real NVML does. */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", device->domain,
             device->bus, device->device);
    memcpy(pci->busId, device->bus_id, sizeof pci->busId);
    pci->domain = device->domain;
    pci->bus = device->bus;
    pci->device = device->device;
    pci->pciDeviceId = device->pci_device_id;
    pci->pciSubSystemId = device->pci_subsystem_id;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, type);
    if (ret == NVML_SUCCESS)
        *type = device->brand;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, major);
    if (ret == NVML_SUCCESS && minor == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS) {
        *major = device->cc_major;
        *minor = device->cc_minor;
    }
    return ret;
}

/* An idle simulated GPU: nothing allocated, nothing reserved. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, memory);
    if (ret == NVML_SUCCESS) {
        memory->total = device->memory_total;
        memory->free = device->memory_total;
        memory->used = 0;
    }
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, memory);
    if (ret != NVML_SUCCESS)
        return ret;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device->memory_total;
    memory->reserved = 0;
    memory->free = device->memory_total;
    memory->used = 0;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                              unsigned int *pendingMode)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, currentMode);
    if (ret == NVML_SUCCESS && pendingMode == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    /* Pre-Ampere and consumer parts have no MIG at all. */
    if (device->mig_mode == MOCK_MIG_NONE)
        return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = (unsigned int)device->mig_mode;
    *pendingMode = (unsigned int)device->mig_mode;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, mode);
    if (ret == NVML_SUCCESS)
        *mode = device->persistence;
    return ret;
}

/* ---- health ----------------------------------------------------------------- */

NVML_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, isPending);
    if (ret == NVML_SUCCESS)
        *isPending = device->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                                   unsigned int *isPending, unsigned int *failureOccurred)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gpu(device, corrRows);
    if (ret != NVML_SUCCESS)
        return ret;
    if (uncRows == NULL || isPending == NULL || failureOccurred == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *corrRows = 0;
    *uncRows = device->remap_pending || device->remap_failure ? 1 : 0;
    *isPending = device->remap_pending;
    *failureOccurred = device->remap_failure;
    return NVML_SUCCESS;
}

/* ---- MIG ------------------------------------------------------------------ */

NVML_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_device(device, isMigDevice);
    if (ret == NVML_SUCCESS)
        *isMigDevice = device->is_mig ? 1u : 0u;
    return ret;
}

/* Zero unless MIG is enabled (nvml.h: "Returns zero if MIG is not supported or enabled"). */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_kind(device, count, 0);
    if (ret == NVML_SUCCESS)
        *count = device->mig_mode == MOCK_MIG_ENABLED ? MOCK_MAX_MIG_PER_GPU : 0;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                             nvmlDevice_t *migDevice)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_kind(device, migDevice, 0);
    if (ret != NVML_SUCCESS)
        return ret;
    if (device->mig_mode == MOCK_MIG_NONE)
        return NVML_ERROR_NOT_SUPPORTED;
    /* Past the maximum (zero with MIG off) the index itself is invalid;
     * below it, a slot without a MIG device is not found. */
    if (device->mig_mode != MOCK_MIG_ENABLED || index >= MOCK_MAX_MIG_PER_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= device->mig_count)
        return NVML_ERROR_NOT_FOUND;
    *migDevice = &g_topo.migs[device->migs[index]];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                      nvmlDevice_t *device)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_kind(migDevice, device, 1);
    if (ret == NVML_SUCCESS)
        *device = &g_topo.devices[migDevice->parent];
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_kind(device, id, 1);
    if (ret == NVML_SUCCESS)
        *id = device->gpu_instance_id;
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_kind(device, id, 1);
    if (ret == NVML_SUCCESS)
        *id = device->compute_instance_id;
    return ret;
}
