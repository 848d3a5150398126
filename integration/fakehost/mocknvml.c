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
 * Two views, chosen at each 0 -> 1 init:
 *  - the host's view, when <root>/etc/mock-nvml/topology exists (the
 *    simulated host's own directory): every GPU and MIG device of the
 *    topology, MIG changes shared through mig-state, as described below.
 *  - the driver's view, when it does not: inside a container gpuhook injected
 *    the library into (root is "/", and gpuhook injects no mock-only file).
 *    The builder compiles the host's topology into the library
 *    (mock_embedded_topology, a second translation unit), standing for what
 *    the real NVML learns from the kernel module; what the process may use is
 *    decided as the real driver decides it.  <root>/dev/nvidiactl must exist
 *    (else NVML_ERROR_DRIVER_NOT_LOADED) and open (else
 *    NVML_ERROR_NO_PERMISSION).  The GPUs are those of the topology whose
 *    <root>/dev/nvidia<minor> the process can open and whose UUID a
 *    <root>/proc/driver/nvidia/gpus/<bus>/information file lists, renumbered
 *    0, 1, ... in topology (PCI) order as NVML numbers the GPUs it sees.  A
 *    GPU's MIG devices are the (gi, ci) pairs whose capability files
 *    <root>/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access and
 *    .../gi<G>/ci<C>/access exist and whose /dev/nvidia-caps/nvidia-cap<minor>
 *    nodes (minors from the files' DeviceFileMinor) the process can open,
 *    numbered in (gi, ci) order.  With <root>/proc/driver/nvidia present its
 *    version file must name the library's driver version (else
 *    NVML_ERROR_LIB_RM_VERSION_MISMATCH).  Without it (no NVIDIA kernel module
 *    on this machine, so gpuhook has no /proc/driver/nvidia to mount its
 *    tmpfs over, as on the development machines) the simulated module's
 *    knowledge built into the library stands in: every topology GPU is
 *    listed, and the capability minors come from the host's mig-minors table
 *    (mock_embedded_mig_minors), so the nodes alone decide.  "Can open" is open(2) succeeding or failing
 *    with ENXIO/ENODEV: the simulated host has no kernel driver behind its
 *    nodes, so a node the device cgroup allows answers ENXIO, and one it
 *    refuses EPERM.  An instance's profile is the topology's (admin-made)
 *    one where it lists that GI, else the GPU's first profile whose placement
 *    fits the GI id (an instance made on demand after the build: its UUID is
 *    exact, its profile name may not be).  MIG changes are
 *    NVML_ERROR_NO_PERMISSION there (no mig/config capability), processes
 *    and calls.log are absent, as their files are.
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
 *     giprofile <gpu index> <NVML profile index> <driver profile id> <compute slices>
 *         <memory slices> <instance count> <memory MiB> <SMs> <CE> <DEC> <ENC> <JPEG> <OFA>
 *         <legal starts, comma-separated> <profile name, rest of the line>
 *     migplacement <gpu index> <gpu instance id> <NVML profile index> <start>
 *     miguuid <gpu index> <gpu instance id> <compute instance id> <uuid>
 * (each record is one line).  <mig> is "none" (MIG not supported), "disabled"
 * or "enabled"; <persistence> is 0 or 1; ids are hex with a 0x prefix.  A mig
 * record is one MIG device of an "enabled" GPU listed before it; a GPU's MIG
 * devices come in creation order, which is their index on the GPU.  giprofile,
 * migplacement and miguuid records come from integration/fakehost/mig.py, the
 * one source of the profile tables, the admin-made instances' placements and
 * the MIG device UUIDs, so this library never invents any of them.
 *
 * MIG management: GPU and compute instances are created and destroyed with
 * the real NVML calls (nvmlDeviceCreateGpuInstance, ...).  The instances that
 * exist are the host's, not a process's: they live in
 *     <root>/etc/mock-nvml/mig-state
 * ("gi <gpu> <gi id> <profile index> <start>" and "ci <gpu> <gi id> <ci id>
 * <ci profile id> <start>" lines in creation order), which every change
 * replaces atomically (rename) while holding flock on mig-state.lock, and
 * which every MIG query re-reads when it has changed, so a create in one
 * process is seen by the next and by long-lived ones.  Until the first change
 * the topology's mig records are the instances (what the admin made at boot).
 * Like the driver, a change also makes or removes the instance's capability
 * files (<root>/proc/driver/nvidia/capabilities/gpuN/mig/giG[/ciC]/access)
 * and its /dev/nvidia-caps/nvidia-capM node (minors from
 * <root>/proc/driver/nvidia-caps/mig-minors, the major from <root>/proc/devices).
 * Changes need root, as with the real driver (the mig/config capability).
 *
 * Running processes: nvmlDeviceGet{Compute,Graphics}RunningProcesses (the
 * unversioned symbols fill nvmlProcessInfo_v1_t, _v2 and _v3 fill
 * nvmlProcessInfo_v2_t, alias nvmlProcessInfo_t) answer from
 *     <root>/etc/mock-nvml/processes
 * read afresh at every call (writers replace it by rename, as
 * FakeHost.set_gpu_processes does, so one open reads one whole version; no
 * file: no processes).  One line per process ('#' comments and blank lines
 * ignored, any other line that does not parse fails the call with
 * NVML_ERROR_UNKNOWN and a message on stderr):
 *     <gpu index> <pid> <used bytes> [<gi> <ci>]   a compute process
 *     graphics <gpu index> <pid> <used bytes>      a graphics process
 * where <used bytes> may be "-" (reported as NVML_VALUE_NOT_AVAILABLE) and
 * <gi> <ci> place the process on a MIG device (both 0xFFFFFFFF otherwise).
 * pids are real processes of this machine: like the driver, which forgets a
 * process's contexts when it exits, the mock leaves out a pid whose
 * /proc/<pid> (the real /proc) is gone or a zombie.  A GPU handle lists the
 * GPU's processes; a MIG device handle those of its GPU with its gi and ci;
 * a GPU in MIG mode lists the aggregate (with the ids) only to euid 0, and
 * NVML_ERROR_NO_PERMISSION otherwise, as nvml.h says; graphics on a MIG
 * device handle is NVML_ERROR_NOT_SUPPORTED.  The count follows NVML:
 * *infoCount in is the capacity of infos (NULL only with 0), out the number
 * of processes; more than fit is NVML_ERROR_INSUFFICIENT_SIZE (the first
 * capacity records filled), none is NVML_SUCCESS with 0.
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
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
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
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
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
#define MOCK_GI_IDS (MOCK_MAX_GPU_INSTANCE_ID + 1)
#define MOCK_CI_IDS (MOCK_MAX_COMPUTE_INSTANCE_ID + 1)
/* NVML_GPU_INSTANCE_PROFILE_COUNT and NVML_COMPUTE_INSTANCE_PROFILE_COUNT. */
#define MOCK_GI_PROFILE_COUNT 0x12
#define MOCK_CI_PROFILE_COUNT 0x9
#define MOCK_MEMORY_SLICES 8
#define MOCK_COMPUTE_SLICES 7
#define MOCK_PROFILE_NAME_SIZE 32

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
    /* A GPU: its MIG devices, in creation order (indices into topology.migs
     * while loading, then flat indices into g_migdevs once the live state is
     * applied). */
    unsigned int mig_count;
    unsigned int migs[MOCK_MAX_MIG_PER_GPU];
    /* An admin-made MIG device: its GI's profile index and placement start
     * (migplacement record), -1 when the topology does not say. */
    int static_profile;
    int static_start;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

/* One GPU instance profile of a GPU (a giprofile record). */
struct gi_profile {
    int present;
    unsigned int id; /* the driver's profile id: what create, placements and capacity take */
    unsigned int slices;
    unsigned int memory_slices; /* also the placement size */
    unsigned int instances;
    unsigned long long memory_mb;
    unsigned int sms, copy_engines, decoders, encoders, jpegs, ofas;
    unsigned int starts; /* bit s set: a placement may start at memory slice s */
    char name[MOCK_PROFILE_NAME_SIZE];
};

/* nvmlGpuInstance_t and nvmlComputeInstance_t point at fixed slots, one per
 * possible (gpu, gi[, ci]), so a handle stays put while the state is re-read
 * and a destroyed instance's handle is simply not live. */
struct nvmlGpuInstance_st {
    int live;
    unsigned int gpu;
    unsigned int id;
    int profile; /* NVML profile index; -1: an admin-made instance of unknown profile */
    unsigned int start;
    unsigned int size;
    unsigned long seq; /* creation order */
};
typedef struct nvmlGpuInstance_st *nvmlGpuInstance_t;

struct nvmlComputeInstance_st {
    int live;
    unsigned int gpu;
    unsigned int gi;
    unsigned int id;
    unsigned int profile; /* NVML_COMPUTE_INSTANCE_PROFILE_*, which is also its id */
    unsigned int start;   /* in the GI's compute slices */
    unsigned int size;
    unsigned long seq;
};
typedef struct nvmlComputeInstance_st *nvmlComputeInstance_t;

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;
typedef nvmlGpuInstancePlacement_t nvmlComputeInstancePlacement_t;

typedef struct {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlGpuInstanceProfileInfo_v2_t;

/* v3 drops isP2pSupported and adds a capabilities mask (nvml.h, R535+). */
typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} nvmlGpuInstanceProfileInfo_v3_t;

#define nvmlGpuInstanceProfileInfo_v2 ((unsigned int)(sizeof(nvmlGpuInstanceProfileInfo_v2_t) | (2u << 24)))
#define nvmlGpuInstanceProfileInfo_v3 ((unsigned int)(sizeof(nvmlGpuInstanceProfileInfo_v3_t) | (3u << 24)))

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlComputeInstanceProfileInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} nvmlComputeInstanceProfileInfo_v3_t;

#define nvmlComputeInstanceProfileInfo_v2 ((unsigned int)(sizeof(nvmlComputeInstanceProfileInfo_v2_t) | (2u << 24)))
#define nvmlComputeInstanceProfileInfo_v3 ((unsigned int)(sizeof(nvmlComputeInstanceProfileInfo_v3_t) | (3u << 24)))

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlComputeInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

struct topology {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int cuda_version;
    unsigned int count;
    struct nvmlDevice_st devices[MOCK_MAX_GPUS];
    /* The admin-made MIG devices (mig records), as the topology lists them. */
    unsigned int mig_total;
    struct nvmlDevice_st migs[MOCK_MAX_MIGS];
    /* Per GPU: its GPU instance profiles by NVML index, and the UUID of each
     * possible MIG device ("" where the topology gives none). */
    struct gi_profile profiles[MOCK_MAX_GPUS][MOCK_GI_PROFILE_COUNT];
    char mig_uuids[MOCK_MAX_GPUS][MOCK_GI_IDS][MOCK_CI_IDS][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
};

/* The host's topology as the builder rendered it (mocknvml-topology.c). */
extern const char mock_embedded_topology[];
/* The host's /proc/driver/nvidia-caps/mig-minors ("" without MIG), for a root without the driver's procfs. */
extern const char mock_embedded_mig_minors[];

/* Which view init chose: 0 the host's (topology file), 1 the driver's (see the header). */
static int g_driver_view;
/* In the driver's view: whether <root>/proc/driver/nvidia exists (see the header). */
static int g_have_procfs;

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
static char g_root[PATH_MAX]; /* the host root; "" stands for "/" */
static char g_state_path[PATH_MAX];
static char g_state_lock_path[PATH_MAX];
static char g_processes_path[PATH_MAX];

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
    join_path(g_state_path, sizeof g_state_path, real, "/etc/mock-nvml/mig-state");
    join_path(g_state_lock_path, sizeof g_state_lock_path, real, "/etc/mock-nvml/mig-state.lock");
    join_path(g_processes_path, sizeof g_processes_path, real, "/etc/mock-nvml/processes");
    join_path(g_root, sizeof g_root, real, "");
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
    const char *source = g_driver_view ? "(embedded topology)" : g_topology_path;
    fprintf(stderr, "mock-nvml: %s:%u: %s\n", source, lineno, why);
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
    dev.static_profile = -1;
    dev.static_start = -1;
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

/* Parses one "giprofile ..." record: one GPU instance profile of a listed GPU. */
static nvmlReturn_t parse_giprofile(struct topology *topo, char *line, unsigned int lineno)
{
    struct gi_profile p;
    unsigned int gpu, index;
    char starts[64];
    int name_at = -1;

    memset(&p, 0, sizeof p);
    int fields = sscanf(line, "giprofile %u %u %u %u %u %u %llu %u %u %u %u %u %u %63s %n", &gpu, &index, &p.id,
                        &p.slices, &p.memory_slices, &p.instances, &p.memory_mb, &p.sms, &p.copy_engines,
                        &p.decoders, &p.encoders, &p.jpegs, &p.ofas, starts, &name_at);
    if (fields != 14 || name_at < 0)
        return topology_error(lineno, "malformed giprofile record");
    if (gpu >= topo->count)
        return topology_error(lineno, "giprofile record before its gpu record");
    if (index >= MOCK_GI_PROFILE_COUNT || topo->profiles[gpu][index].present)
        return topology_error(lineno, "bad or duplicate giprofile index");
    if (p.slices == 0 || p.slices > MOCK_COMPUTE_SLICES || p.memory_slices == 0 ||
        p.memory_slices > MOCK_MEMORY_SLICES || (p.memory_slices & (p.memory_slices - 1)) != 0)
        return topology_error(lineno, "giprofile slices out of range");
    for (char *token = strtok(starts, ","); token != NULL; token = strtok(NULL, ",")) {
        char *end;
        unsigned long start = strtoul(token, &end, 10);
        if (*end != '\0' || start % p.memory_slices != 0 || start + p.memory_slices > MOCK_MEMORY_SLICES)
            return topology_error(lineno, "giprofile start must be aligned to its size and on the GPU");
        p.starts |= 1u << start;
    }
    if (copy_field(p.name, sizeof p.name, line + name_at) != 0)
        return topology_error(lineno, "missing or overlong giprofile name");
    p.present = 1;
    topo->profiles[gpu][index] = p;
    return NVML_SUCCESS;
}

/* Parses one "migplacement <gpu> <gi> <profile index> <start>" record for an admin-made GI. */
static nvmlReturn_t parse_migplacement(struct topology *topo, char *line, unsigned int lineno)
{
    unsigned int gpu, gi, profile, start;
    int seen = 0;

    if (sscanf(line, "migplacement %u %u %u %u", &gpu, &gi, &profile, &start) != 4)
        return topology_error(lineno, "malformed migplacement record");
    if (gpu >= topo->count || profile >= MOCK_GI_PROFILE_COUNT || !topo->profiles[gpu][profile].present)
        return topology_error(lineno, "migplacement for an unknown gpu or profile");
    if (!(topo->profiles[gpu][profile].starts & (1u << start)))
        return topology_error(lineno, "migplacement start is not a legal placement of its profile");
    for (unsigned int i = 0; i < topo->mig_total; i++) {
        struct nvmlDevice_st *mig = &topo->migs[i];
        if (mig->parent == gpu && mig->gpu_instance_id == gi) {
            mig->static_profile = (int)profile;
            mig->static_start = (int)start;
            seen = 1;
        }
    }
    return seen ? NVML_SUCCESS : topology_error(lineno, "migplacement for a gpu instance no mig record lists");
}

/* Parses one "miguuid <gpu> <gi> <ci> <uuid>" record. */
static nvmlReturn_t parse_miguuid(struct topology *topo, char *line, unsigned int lineno)
{
    unsigned int gpu, gi, ci;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];

    if (sscanf(line, "miguuid %u %u %u %95s", &gpu, &gi, &ci, uuid) != 4)
        return topology_error(lineno, "malformed miguuid record");
    if (gpu >= topo->count || gi >= MOCK_GI_IDS || ci >= MOCK_CI_IDS || strncmp(uuid, "MIG-", 4) != 0)
        return topology_error(lineno, "miguuid out of range or not a MIG- uuid");
    memcpy(topo->mig_uuids[gpu][gi][ci], uuid, strlen(uuid) + 1);
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
    if (strncmp(line, "giprofile ", 10) == 0)
        return parse_giprofile(topo, line, lineno);
    if (strncmp(line, "migplacement ", 13) == 0)
        return parse_migplacement(topo, line, lineno);
    if (strncmp(line, "miguuid ", 8) == 0)
        return parse_miguuid(topo, line, lineno);
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

/* Reads a whole topology (the file, or the embedded copy) into *topo. */
static nvmlReturn_t load_topology(struct topology *topo, FILE *file)
{
    char line[512];
    unsigned int lineno = 0;
    int saw_header = 0;
    nvmlReturn_t ret = NVML_SUCCESS;

    memset(topo, 0, sizeof *topo);
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
    if (ret == NVML_SUCCESS && (!saw_header || topo->driver_version[0] == '\0' ||
                                topo->nvml_version[0] == '\0' || topo->cuda_version <= 0))
        ret = topology_error(lineno, "missing header, driver, nvml or cuda record");
    return ret;
}

/* ---- helpers for the entry points --------------------------------------- */

static struct nvmlDevice_st g_migdevs[MOCK_MAX_GPUS][MOCK_GI_IDS][MOCK_CI_IDS];
#define MOCK_MIGDEV_SLOTS (MOCK_MAX_GPUS * MOCK_GI_IDS * MOCK_CI_IDS)
#define g_migdev_flat (&g_migdevs[0][0][0])
static pthread_mutex_t g_mig_lock = PTHREAD_MUTEX_INITIALIZER;
static void refresh_state(int force);

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
    return in_table(device, g_topo.devices, g_topo.count) ||
           (in_table(device, g_migdev_flat, MOCK_MIGDEV_SLOTS) && device->is_mig);
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

/* ---- live MIG state ------------------------------------------------------ */

static struct nvmlGpuInstance_st g_gis[MOCK_MAX_GPUS][MOCK_GI_IDS];
static struct nvmlComputeInstance_st g_cis[MOCK_MAX_GPUS][MOCK_GI_IDS][MOCK_CI_IDS];
/* The MIG device handles (g_migdevs, declared above: one slot per (gpu, gi,
 * ci), is_mig marks a live one).  MIG state changes and re-reads happen under
 * g_mig_lock (NVML is called from many threads); flock on mig-state.lock
 * orders changes across processes. */
static unsigned long g_seq;
/* What the applied state was read from: 0 = the topology's mig records, 1 = mig-state. */
static int g_state_source = -1;
static struct stat g_state_stat;

/* The GI id the driver gives a placement (mig.py's swizzle_gi_id): the node of
 * the binary tree over the 8 memory slices, whole GPU 0, halves 1-2,
 * quarters 3-6, eighths 7-14. */
static unsigned int gi_id_of(unsigned int start, unsigned int size)
{
    switch (size) {
    case 8: return 0;
    case 4: return 1 + start / 4;
    case 2: return 3 + start / 2;
    default: return 7 + start;
    }
}

/* The reverse, for admin-made instances whose placement the topology does not give. */
static void placement_of_gi(unsigned int gi, unsigned int *start, unsigned int *size)
{
    if (gi == 0) { *start = 0; *size = 8; }
    else if (gi <= 2) { *start = (gi - 1) * 4; *size = 4; }
    else if (gi <= 6) { *start = (gi - 3) * 2; *size = 2; }
    else { *start = gi - 7; *size = 1; }
}

/* Compute slices of NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE (0-4); 0 for the
 * profiles no simulated GPU offers. */
static unsigned int ci_profile_slices(unsigned int profile)
{
    static const unsigned int slices[] = {1, 2, 3, 4, 7};
    return profile < sizeof slices / sizeof slices[0] ? slices[profile] : 0;
}

/* Whether a GI of gi_slices compute slices offers CI profile p: sizes up to the
 * GI's, except 3c in a 4g (nvidia-smi mig -lcip: 4g has 1c, 2c, 4c). */
static int ci_profile_fits(unsigned int profile, unsigned int gi_slices)
{
    unsigned int s = ci_profile_slices(profile);
    return s != 0 && s <= gi_slices && !(s == 3 && gi_slices == 4);
}

static const struct gi_profile *gi_profile_of(const struct nvmlGpuInstance_st *gi)
{
    if (gi->profile < 0)
        return NULL;
    const struct gi_profile *p = &g_topo.profiles[gi->gpu][gi->profile];
    return p->present ? p : NULL;
}

/* The CI's profile name: the GI's for a CI that spans it, "<n>c.<gi>" otherwise. */
static void ci_name(const struct nvmlGpuInstance_st *gi, unsigned int ci_profile, char *out, size_t size)
{
    const struct gi_profile *p = gi_profile_of(gi);
    const char *gi_name = p != NULL ? p->name : "unknown";
    unsigned int s = ci_profile_slices(ci_profile);
    if (p == NULL || s == p->slices)
        snprintf(out, size, "%s", gi_name);
    else
        snprintf(out, size, "%uc.%s", s, gi_name);
}

/* The admin-made MIG device the topology lists for (gpu, gi, ci), if its GI still has that profile. */
static const struct nvmlDevice_st *static_mig(unsigned int gpu, const struct nvmlGpuInstance_st *gi, unsigned int ci)
{
    for (unsigned int i = 0; i < g_topo.mig_total; i++) {
        const struct nvmlDevice_st *mig = &g_topo.migs[i];
        if (mig->parent == gpu && mig->gpu_instance_id == gi->id && mig->compute_instance_id == ci &&
            mig->static_profile == gi->profile)
            return mig;
    }
    return NULL;
}

/* Fills the MIG device slot of a live CI from its GPU, GI and CI. */
static void fill_migdev(const struct nvmlComputeInstance_st *ci)
{
    struct nvmlDevice_st *dev = &g_migdevs[ci->gpu][ci->gi][ci->id];
    const struct nvmlDevice_st *gpu = &g_topo.devices[ci->gpu];
    const struct nvmlGpuInstance_st *gi = &g_gis[ci->gpu][ci->gi];
    const struct nvmlDevice_st *admin = static_mig(ci->gpu, gi, ci->id);

    memset(dev, 0, sizeof *dev);
    if (admin != NULL) {
        *dev = *admin;
    } else {
        const struct gi_profile *p = gi_profile_of(gi);
        char name[MOCK_PROFILE_NAME_SIZE + 8];
        const char *uuid = g_topo.mig_uuids[ci->gpu][ci->gi][ci->id];
        ci_name(gi, ci->profile, name, sizeof name);
        if (uuid[0] != '\0')
            snprintf(dev->uuid, sizeof dev->uuid, "%s", uuid);
        else /* a hand-written topology without miguuid records: the legacy form NVML also accepts */
            snprintf(dev->uuid, sizeof dev->uuid, "MIG-%.40s/%u/%u", gpu->uuid, ci->gi, ci->id);
        snprintf(dev->name, sizeof dev->name, "%.56s MIG %.34s", gpu->name, name);
        dev->memory_total = p != NULL ? p->memory_mb * 1024ull * 1024ull : 0;
    }
    dev->is_mig = 1;
    dev->parent = ci->gpu;
    dev->gpu_instance_id = ci->gi;
    dev->compute_instance_id = ci->id;
    dev->minor = gpu->minor;
    dev->cc_major = gpu->cc_major;
    dev->cc_minor = gpu->cc_minor;
    dev->brand = gpu->brand;
    dev->mig_mode = MOCK_MIG_NONE;
    dev->persistence = gpu->persistence;
    dev->mig_count = 0;
}

static void clear_state(void)
{
    memset(g_gis, 0, sizeof g_gis);
    memset(g_cis, 0, sizeof g_cis);
    for (unsigned int i = 0; i < MOCK_MIGDEV_SLOTS; i++)
        g_migdev_flat[i].is_mig = 0;
    g_seq = 0;
}

static int add_gi(unsigned int gpu, unsigned int id, int profile, unsigned int start, unsigned int size)
{
    if (gpu >= g_topo.count || id >= MOCK_GI_IDS || g_gis[gpu][id].live)
        return -1;
    g_gis[gpu][id] = (struct nvmlGpuInstance_st){1, gpu, id, profile, start, size, ++g_seq};
    return 0;
}

static int add_ci(unsigned int gpu, unsigned int gi, unsigned int id, unsigned int profile, unsigned int start)
{
    if (gpu >= g_topo.count || gi >= MOCK_GI_IDS || id >= MOCK_CI_IDS || !g_gis[gpu][gi].live ||
        g_cis[gpu][gi][id].live)
        return -1;
    g_cis[gpu][gi][id] =
        (struct nvmlComputeInstance_st){1, gpu, gi, id, profile, start, ci_profile_slices(profile), ++g_seq};
    return 0;
}

/* Rebuilds every GPU's MIG device list (creation order of the CIs) and the device slots. */
static void index_migdevs(void)
{
    for (unsigned int i = 0; i < MOCK_MIGDEV_SLOTS; i++)
        g_migdev_flat[i].is_mig = 0;
    for (unsigned int gpu = 0; gpu < g_topo.count; gpu++) {
        struct nvmlDevice_st *dev = &g_topo.devices[gpu];
        unsigned long last = 0;
        dev->mig_count = 0;
        /* Selection by sequence number; at most 7 CIs per GPU, so this stays tiny. */
        while (dev->mig_count < MOCK_MAX_MIG_PER_GPU) {
            struct nvmlComputeInstance_st *next = NULL;
            for (unsigned int gi = 0; gi < MOCK_GI_IDS; gi++)
                for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++) {
                    struct nvmlComputeInstance_st *c = &g_cis[gpu][gi][ci];
                    if (c->live && c->seq > last && (next == NULL || c->seq < next->seq))
                        next = c;
                }
            if (next == NULL)
                break;
            last = next->seq;
            fill_migdev(next);
            dev->migs[dev->mig_count++] = (unsigned int)(&g_migdevs[gpu][next->gi][next->id] - g_migdev_flat);
        }
    }
}

/* The admin-made instances of the topology's mig records. */
static void seed_from_topology(void)
{
    clear_state();
    for (unsigned int i = 0; i < g_topo.mig_total; i++) {
        const struct nvmlDevice_st *mig = &g_topo.migs[i];
        unsigned int start, size;
        placement_of_gi(mig->gpu_instance_id, &start, &size);
        if (mig->static_profile >= 0) {
            start = (unsigned int)mig->static_start;
            size = g_topo.profiles[mig->parent][mig->static_profile].memory_slices;
        }
        if (!g_gis[mig->parent][mig->gpu_instance_id].live)
            add_gi(mig->parent, mig->gpu_instance_id, mig->static_profile, start, size);
        /* Admin-made instances have one CI spanning the GI. */
        unsigned int ci_profile = 0;
        const struct gi_profile *p = gi_profile_of(&g_gis[mig->parent][mig->gpu_instance_id]);
        for (unsigned int cp = 0; p != NULL && cp < MOCK_CI_PROFILE_COUNT; cp++)
            if (ci_profile_slices(cp) == p->slices)
                ci_profile = cp;
        add_ci(mig->parent, mig->gpu_instance_id, mig->compute_instance_id, ci_profile, 0);
    }
}

/* Reads mig-state into the tables; -1 (tables cleared) if it is malformed. */
static int read_state_file(FILE *file)
{
    char line[256];
    int ok = 1;

    clear_state();
    if (fgets(line, sizeof line, file) == NULL || strcmp(line, "mock-nvml-mig-state 1\n") != 0)
        ok = 0;
    while (ok && fgets(line, sizeof line, file) != NULL) {
        unsigned int gpu, gi, ci, profile, start;
        int iprofile;
        if (sscanf(line, "gi %u %u %d %u", &gpu, &gi, &iprofile, &start) == 4) {
            unsigned int size, ignored;
            placement_of_gi(gi, &ignored, &size);
            if (gpu < g_topo.count && iprofile >= 0 && iprofile < MOCK_GI_PROFILE_COUNT &&
                g_topo.profiles[gpu][iprofile].present)
                size = g_topo.profiles[gpu][iprofile].memory_slices;
            ok = add_gi(gpu, gi, iprofile, start, size) == 0;
        } else if (sscanf(line, "ci %u %u %u %u %u", &gpu, &gi, &ci, &profile, &start) == 5) {
            ok = add_ci(gpu, gi, ci, profile, start) == 0;
        } else {
            ok = 0;
        }
    }
    if (!ok) {
        fprintf(stderr, "mock-nvml: %s is malformed; no MIG instances\n", g_state_path);
        clear_state();
        return -1;
    }
    return 0;
}

/* ---- the driver's view (see the header) ----------------------------------- */

/* Whether this process may use the node at root-relative path rel: open(2)
 * works, or says there is no driver behind an allowed node (ENXIO, ENODEV). */
static int node_usable(const char *rel)
{
    char path[PATH_MAX + 64];
    struct stat st;

    snprintf(path, sizeof path, "%s%s", g_root, rel);
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode))
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd >= 0) {
        close(fd);
        return 1;
    }
    return errno == ENXIO || errno == ENODEV;
}

/* The DeviceFileMinor of a MIG capability file (gi, or ci when ci >= 0), or -1 when it is absent. */
static long cap_file_minor(unsigned int gpu_minor, unsigned int gi, int ci)
{
    char dir[PATH_MAX + 96], path[PATH_MAX + 128], line[128];
    long minor = -1;

    if (!g_have_procfs) {
        /* The module's table: "gpu<minor>/gi<G>[/ci<C>]/access <minor>" lines. */
        char want[96];
        if (ci < 0)
            snprintf(want, sizeof want, "\ngpu%u/gi%u/access ", gpu_minor, gi);
        else
            snprintf(want, sizeof want, "\ngpu%u/gi%u/ci%d/access ", gpu_minor, gi, ci);
        const char *at = strstr(mock_embedded_mig_minors, want);
        return at != NULL ? strtol(at + strlen(want), NULL, 10) : -1;
    }
    if (ci < 0)
        snprintf(dir, sizeof dir, "%s/proc/driver/nvidia/capabilities/gpu%u/mig/gi%u", g_root, gpu_minor, gi);
    else
        snprintf(dir, sizeof dir, "%s/proc/driver/nvidia/capabilities/gpu%u/mig/gi%u/ci%d", g_root, gpu_minor, gi,
                 ci);
    snprintf(path, sizeof path, "%s/access", dir);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return -1;
    while (minor < 0 && fgets(line, sizeof line, file) != NULL)
        if (sscanf(line, "DeviceFileMinor: %ld", &minor) != 1)
            minor = -1;
    fclose(file);
    return minor;
}

/* Whether the process holds the capability of a GI (ci < 0) or CI: its file and its node. */
static int cap_usable(unsigned int gpu_minor, unsigned int gi, int ci)
{
    char node[64];
    long minor = cap_file_minor(gpu_minor, gi, ci);
    if (minor < 0)
        return 0;
    snprintf(node, sizeof node, "/dev/nvidia-caps/nvidia-cap%ld", minor);
    return node_usable(node);
}

/* The admin-made MIG record of (gpu, gi), or NULL. */
static const struct nvmlDevice_st *static_gi(unsigned int gpu, unsigned int gi)
{
    for (unsigned int i = 0; i < g_topo.mig_total; i++)
        if (g_topo.migs[i].parent == gpu && g_topo.migs[i].gpu_instance_id == gi)
            return &g_topo.migs[i];
    return NULL;
}

/* The MIG instances this process holds the capabilities of, as the tables. */
static void seed_from_capabilities(void)
{
    clear_state();
    for (unsigned int gpu = 0; gpu < g_topo.count; gpu++) {
        const struct nvmlDevice_st *dev = &g_topo.devices[gpu];
        if (dev->mig_mode != MOCK_MIG_ENABLED)
            continue;
        for (unsigned int gi = 0; gi < MOCK_GI_IDS; gi++) {
            if (!cap_usable(dev->minor, gi, -1))
                continue;
            unsigned int start, size;
            int profile = -1;
            placement_of_gi(gi, &start, &size);
            const struct nvmlDevice_st *admin = static_gi(gpu, gi);
            if (admin != NULL && admin->static_profile >= 0) {
                profile = admin->static_profile;
                start = (unsigned int)admin->static_start;
                size = g_topo.profiles[gpu][profile].memory_slices;
            } else {
                for (int p = 0; p < MOCK_GI_PROFILE_COUNT && profile < 0; p++) {
                    const struct gi_profile *gp = &g_topo.profiles[gpu][p];
                    if (gp->present && gp->memory_slices == size && (gp->starts & (1u << start)))
                        profile = p;
                }
            }
            add_gi(gpu, gi, profile, start, size);
            /* One CI spanning the GI, as admin-made and MIG-on-demand instances have. */
            unsigned int ci_profile = 0;
            const struct gi_profile *gp = gi_profile_of(&g_gis[gpu][gi]);
            for (unsigned int cp = 0; gp != NULL && cp < MOCK_CI_PROFILE_COUNT; cp++)
                if (ci_profile_slices(cp) == gp->slices)
                    ci_profile = cp;
            for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++)
                if (cap_usable(dev->minor, gi, (int)ci))
                    add_ci(gpu, gi, ci, ci_profile, 0);
        }
    }
}

/* Brings the tables up to date with the host: mig-state if it exists (re-read
 * only when it was replaced), the topology's mig records otherwise.  Called
 * with g_mig_lock held. */
static void refresh_state(int force)
{
    struct stat st;
    ensure_paths();
    if (g_driver_view) {
        /* What a container holds does not change under it: read once per init. */
        if (force || g_state_source != 2) {
            seed_from_capabilities();
            index_migdevs();
            g_state_source = 2;
        }
        return;
    }
    if (g_state_path[0] == '\0' || stat(g_state_path, &st) != 0) {
        if (force || g_state_source != 0) {
            seed_from_topology();
            index_migdevs();
            g_state_source = 0;
        }
        return;
    }
    if (!force && g_state_source == 1 && st.st_ino == g_state_stat.st_ino && st.st_dev == g_state_stat.st_dev &&
        st.st_mtim.tv_sec == g_state_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_state_stat.st_mtim.tv_nsec &&
        st.st_size == g_state_stat.st_size)
        return;
    FILE *file = fopen(g_state_path, "re");
    if (file == NULL) {
        clear_state();
    } else {
        /* fstat the file actually read: a concurrent rename must not be mistaken for it. */
        if (fstat(fileno(file), &st) != 0)
            memset(&st, 0, sizeof st);
        read_state_file(file);
        fclose(file);
    }
    index_migdevs();
    g_state_source = 1;
    g_state_stat = st;
}

/* Writes the tables to mig-state (creation order) through a temporary file and rename. */
static int write_state(void)
{
    char tmp[PATH_MAX + 32];
    unsigned long last = 0;

    if (snprintf(tmp, sizeof tmp, "%s.%ld", g_state_path, (long)getpid()) >= (int)sizeof tmp)
        return -1;
    FILE *file = fopen(tmp, "we");
    if (file == NULL)
        return -1;
    fprintf(file, "mock-nvml-mig-state 1\n");
    for (;;) {
        struct nvmlGpuInstance_st *gi_next = NULL;
        struct nvmlComputeInstance_st *ci_next = NULL;
        unsigned long best = 0;
        for (unsigned int gpu = 0; gpu < g_topo.count; gpu++)
            for (unsigned int gi = 0; gi < MOCK_GI_IDS; gi++) {
                struct nvmlGpuInstance_st *g = &g_gis[gpu][gi];
                if (g->live && g->seq > last && (best == 0 || g->seq < best)) {
                    best = g->seq; gi_next = g; ci_next = NULL;
                }
                for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++) {
                    struct nvmlComputeInstance_st *c = &g_cis[gpu][gi][ci];
                    if (c->live && c->seq > last && (best == 0 || c->seq < best)) {
                        best = c->seq; ci_next = c; gi_next = NULL;
                    }
                }
            }
        if (best == 0)
            break;
        last = best;
        if (gi_next != NULL)
            fprintf(file, "gi %u %u %d %u\n", gi_next->gpu, gi_next->id, gi_next->profile, gi_next->start);
        else
            fprintf(file, "ci %u %u %u %u %u\n", ci_next->gpu, ci_next->gi, ci_next->id, ci_next->profile,
                    ci_next->start);
    }
    int failed = ferror(file);
    failed |= fclose(file) != 0;
    /* World-readable: unprivileged processes query the instances too. */
    if (failed || chmod(tmp, 0644) != 0 || rename(tmp, g_state_path) != 0) {
        unlink(tmp);
        return -1;
    }
    struct stat st;
    if (stat(g_state_path, &st) == 0) {
        g_state_source = 1;
        g_state_stat = st;
    }
    return 0;
}

/* ---- the driver's side effects: capability files and nodes ---------------- */

/* The minor mig-minors gives "gpu<minor>/gi<gi>[/ci<ci>]/access", or -1. */
static long caps_minor(unsigned int gpu_minor, unsigned int gi, int ci)
{
    char path[PATH_MAX + 64], want[96], line[128];
    long minor = -1;

    snprintf(path, sizeof path, "%s/proc/driver/nvidia-caps/mig-minors", g_root);
    if (ci < 0)
        snprintf(want, sizeof want, "gpu%u/gi%u/access", gpu_minor, gi);
    else
        snprintf(want, sizeof want, "gpu%u/gi%u/ci%d/access", gpu_minor, gi, ci);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return -1;
    size_t len = strlen(want);
    while (minor < 0 && fgets(line, sizeof line, file) != NULL)
        if (strncmp(line, want, len) == 0 && line[len] == ' ')
            minor = strtol(line + len + 1, NULL, 10);
    fclose(file);
    return minor;
}

/* The nvidia-caps major from /proc/devices, or -1. */
static long caps_major(void)
{
    char path[PATH_MAX + 32], line[128], name[96];
    long major = -1, number;

    snprintf(path, sizeof path, "%s/proc/devices", g_root);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return -1;
    while (major < 0 && fgets(line, sizeof line, file) != NULL)
        if (sscanf(line, " %ld %95s", &number, name) == 2 && strcmp(name, "nvidia-caps") == 0)
            major = number;
    fclose(file);
    return major;
}

/* mkdir -p of dir (inside the host root), 0755. */
static int make_dirs(char *dir)
{
    for (char *slash = strchr(dir + 1, '/'); slash != NULL; slash = strchr(slash + 1, '/')) {
        *slash = '\0';
        int failed = mkdir(dir, 0755) != 0 && errno != EEXIST;
        *slash = '/';
        if (failed)
            return -1;
    }
    return mkdir(dir, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

/* The capability directory of a GI or CI: .../capabilities/gpuN/mig/giG[/ciC]. */
static void caps_dir(char *out, size_t size, unsigned int gpu_minor, unsigned int gi, int ci)
{
    if (ci < 0)
        snprintf(out, size, "%s/proc/driver/nvidia/capabilities/gpu%u/mig/gi%u", g_root, gpu_minor, gi);
    else
        snprintf(out, size, "%s/proc/driver/nvidia/capabilities/gpu%u/mig/gi%u/ci%d", g_root, gpu_minor, gi, ci);
}

/* What the driver makes for a new GI (ci < 0) or CI: its capability file,
 * as mig.py's capability_file() words it (mode 0444, i.e. 292), and the node
 * nvidia-modprobe would make from it. */
static int caps_create(unsigned int gpu_minor, unsigned int gi, int ci)
{
    char dir[PATH_MAX + 96], file_path[PATH_MAX + 128], node[PATH_MAX + 64];
    long minor = caps_minor(gpu_minor, gi, ci);
    long major = caps_major();

    if (minor < 0 || major < 0)
        return -1;
    caps_dir(dir, sizeof dir, gpu_minor, gi, ci);
    snprintf(file_path, sizeof file_path, "%s/access", dir);
    if (make_dirs(dir) != 0)
        return -1;
    FILE *file = fopen(file_path, "we");
    if (file == NULL)
        return -1;
    fprintf(file, "DeviceFileMinor: %ld\nDeviceFileMode: %d\nDeviceFileModify: 1\n", minor, 0444);
    if (fclose(file) != 0 || chmod(file_path, 0444) != 0)
        return -1;
    snprintf(node, sizeof node, "%s/dev/nvidia-caps", g_root);
    if (make_dirs(node) != 0)
        return -1;
    snprintf(node, sizeof node, "%s/dev/nvidia-caps/nvidia-cap%ld", g_root, minor);
    unlink(node);
    if (mknod(node, S_IFCHR | 0444, makedev((unsigned int)major, (unsigned int)minor)) != 0 || chmod(node, 0444) != 0)
        return -1;
    return 0;
}

/* Undoes caps_create: the access file, the directory (a GI's ciC directories
 * are gone by then: a GI with CIs cannot be destroyed) and the node. */
static void caps_remove(unsigned int gpu_minor, unsigned int gi, int ci)
{
    char dir[PATH_MAX + 96], file_path[PATH_MAX + 128], node[PATH_MAX + 64];
    long minor = caps_minor(gpu_minor, gi, ci);

    caps_dir(dir, sizeof dir, gpu_minor, gi, ci);
    snprintf(file_path, sizeof file_path, "%s/access", dir);
    unlink(file_path);
    rmdir(dir);
    if (minor >= 0) {
        snprintf(node, sizeof node, "%s/dev/nvidia-caps/nvidia-cap%ld", g_root, minor);
        unlink(node);
    }
}

/* ---- initialisation ----------------------------------------------------- */

/* Whether a <root>/proc/driver/nvidia/gpus/<bus>/information file lists uuid. */
static int procfs_lists_gpu(const char *uuid)
{
    char dir_path[PATH_MAX + 32], path[PATH_MAX + 320], line[256], listed[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    int found = 0;

    if (!g_have_procfs)
        return 1;
    snprintf(dir_path, sizeof dir_path, "%s/proc/driver/nvidia/gpus", g_root);
    DIR *dir = opendir(dir_path);
    if (dir == NULL)
        return 0;
    for (struct dirent *entry = readdir(dir); entry != NULL && !found; entry = readdir(dir)) {
        if (entry->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s/information", dir_path, entry->d_name);
        FILE *file = fopen(path, "re");
        if (file == NULL)
            continue;
        while (!found && fgets(line, sizeof line, file) != NULL)
            found = sscanf(line, "GPU UUID: %95s", listed) == 1 && strcmp(listed, uuid) == 0;
        fclose(file);
    }
    closedir(dir);
    return found;
}

/* Keeps the GPUs the driver lists and the process can open, renumbered in
 * topology order, with their profiles, MIG UUIDs and admin-made MIG records. */
static void keep_usable_gpus(struct topology *topo)
{
    static struct topology kept; /* ~1 MiB: not on the stack; init holds g_lock */
    int map[MOCK_MAX_GPUS];

    memset(&kept, 0, sizeof kept);
    memcpy(kept.driver_version, topo->driver_version, sizeof kept.driver_version);
    memcpy(kept.nvml_version, topo->nvml_version, sizeof kept.nvml_version);
    kept.cuda_version = topo->cuda_version;
    for (unsigned int i = 0; i < topo->count; i++) {
        char node[32];
        struct nvmlDevice_st *dev = &topo->devices[i];
        snprintf(node, sizeof node, "/dev/nvidia%u", dev->minor);
        map[i] = -1;
        if (!procfs_lists_gpu(dev->uuid) || !node_usable(node))
            continue;
        unsigned int j = kept.count++;
        map[i] = (int)j;
        kept.devices[j] = *dev;
        kept.devices[j].index = j;
        kept.devices[j].mig_count = 0;
        memcpy(kept.profiles[j], topo->profiles[i], sizeof kept.profiles[j]);
        memcpy(kept.mig_uuids[j], topo->mig_uuids[i], sizeof kept.mig_uuids[j]);
    }
    for (unsigned int m = 0; m < topo->mig_total; m++) {
        struct nvmlDevice_st mig = topo->migs[m];
        if (map[mig.parent] < 0)
            continue;
        struct nvmlDevice_st *parent = &kept.devices[map[mig.parent]];
        mig.parent = (unsigned int)map[mig.parent];
        mig.index = parent->mig_count;
        parent->migs[parent->mig_count++] = kept.mig_total;
        kept.migs[kept.mig_total++] = mig;
    }
    memcpy(topo, &kept, sizeof kept);
}

/* The driver's view's checks: a control node, usable, and the module's version where procfs has one. */
static nvmlReturn_t check_driver(const struct topology *topo)
{
    char path[PATH_MAX + 48], line[256], version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    struct stat st;
    int matches = 0;

    snprintf(path, sizeof path, "%s/dev/nvidiactl", g_root);
    if (stat(path, &st) != 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (!node_usable("/dev/nvidiactl"))
        return NVML_ERROR_NO_PERMISSION;
    snprintf(path, sizeof path, "%s/proc/driver/nvidia", g_root);
    g_have_procfs = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    if (!g_have_procfs)
        return NVML_SUCCESS;
    snprintf(path, sizeof path, "%s/proc/driver/nvidia/version", g_root);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    /* "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  <build date>" */
    if (fgets(line, sizeof line, file) != NULL &&
        sscanf(line, "NVRM version: NVIDIA UNIX %*s Kernel Module %79s", version) == 1)
        matches = strcmp(version, topo->driver_version) == 0;
    fclose(file);
    return matches ? NVML_SUCCESS : NVML_ERROR_LIB_RM_VERSION_MISMATCH;
}

/* Loads the topology of the view that applies: the host's file, or the embedded copy through the driver. */
static nvmlReturn_t load_view(struct topology *topo)
{
    ensure_paths();
    FILE *file = g_topology_path[0] ? fopen(g_topology_path, "re") : NULL;
    g_driver_view = file == NULL;
    if (file == NULL) {
        /* A library copied to a root without procfs has no driver, which real NVML reports the same way. */
        file = fmemopen((void *)mock_embedded_topology, strlen(mock_embedded_topology), "r");
        if (file == NULL)
            return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    nvmlReturn_t ret = load_topology(topo, file);
    fclose(file);
    if (ret == NVML_SUCCESS && g_driver_view) {
        ret = check_driver(topo);
        if (ret == NVML_SUCCESS)
            keep_usable_gpus(topo);
    }
    return ret;
}

static nvmlReturn_t init_common(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;

    pthread_mutex_lock(&g_lock);
    if (atomic_load(&g_refcount) == 0) {
        ret = load_view(&g_topo);
        pthread_mutex_lock(&g_mig_lock);
        refresh_state(1);
        pthread_mutex_unlock(&g_mig_lock);
    }
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
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
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
    for (unsigned int i = 0; i < MOCK_MIGDEV_SLOTS; i++) {
        struct nvmlDevice_st *mig = &g_migdev_flat[i];
        if (mig->is_mig && mig->gpu_instance_id == gi && mig->compute_instance_id == ci &&
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
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    nvmlReturn_t ret = NVML_ERROR_NOT_FOUND;
    for (unsigned int i = 0; i < MOCK_MIGDEV_SLOTS && ret != NVML_SUCCESS; i++) {
        if (g_migdev_flat[i].is_mig && strcmp(g_migdev_flat[i].uuid, uuid) == 0) {
            *device = &g_migdev_flat[i];
            ret = NVML_SUCCESS;
        }
    }
    if (ret != NVML_SUCCESS)
        ret = mig_by_legacy_uuid(uuid, device);
    pthread_mutex_unlock(&g_mig_lock);
    return ret;
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

static nvmlReturn_t pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
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

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    COUNT_CALL();
    return pci_info(device, pci);
}

/* _v2 fills the same struct (the 8-digit-domain busId came with it). */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    COUNT_CALL();
    return pci_info(device, pci);
}

/* nvmlPciInfo_t as the unversioned (pre-v2) call fills it: a 16-byte busId in
 * the 4-digit-domain form, no busIdLegacy, four reserved words. */
typedef struct {
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0;
    unsigned int reserved1;
    unsigned int reserved2;
    unsigned int reserved3;
} nvmlPciInfo_v1_t;

/* The unversioned symbol that older clients (NVIDIA's nvidia-container-cli among them) resolve. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v1_t *pci)
{
    nvmlPciInfo_t full;
    COUNT_CALL();
    if (pci == NULL)
        return check_gpu(device, pci);
    nvmlReturn_t ret = pci_info(device, &full);
    if (ret != NVML_SUCCESS)
        return ret;
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busId, full.busIdLegacy, sizeof pci->busId);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
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

/* ---- running processes -------------------------------------------------- */

/* nvmlProcessInfo_v1_t, filled by the unversioned calls. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvmlProcessInfo_v2_t, which nvml.h also names nvmlProcessInfo_t: what the
 * _v2 and _v3 calls fill.  It starts with the v1 layout. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;     /* 0xFFFFFFFF outside MIG */
    unsigned int computeInstanceId; /* 0xFFFFFFFF outside MIG */
} nvmlProcessInfo_v2_t;
typedef nvmlProcessInfo_v2_t nvmlProcessInfo_t;

#define MOCK_NO_INSTANCE 0xFFFFFFFFu
#define MOCK_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFull /* NVML_VALUE_NOT_AVAILABLE */
#define MOCK_PROC_COMPUTE 0
#define MOCK_PROC_GRAPHICS 1

/* Whether pid is a live process of this machine (a zombie has exited and
 * lost its GPU contexts, so it does not count): /proc/<pid>/stat's state. */
static int pid_alive(unsigned int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0)
        return 0;
    buf[len] = '\0';
    const char *paren = strrchr(buf, ')'); /* the command name may hold anything but ends at the last ')' */
    if (paren == NULL || paren[1] != ' ')
        return 0;
    return paren[2] != 'Z' && paren[2] != 'X' && paren[2] != 'x';
}

/* An unsigned decimal token, entirely; "-" for used bytes is NVML_VALUE_NOT_AVAILABLE. */
static int parse_number(const char *token, unsigned long long max, unsigned long long *value)
{
    char *end;
    if (token == NULL || token[0] < '0' || token[0] > '9')
        return -1;
    errno = 0;
    unsigned long long number = strtoull(token, &end, 10);
    if (errno != 0 || *end != '\0' || number > max)
        return -1;
    *value = number;
    return 0;
}

struct process_line {
    int kind;
    unsigned int gpu, pid, gi, ci;
    unsigned long long used;
};

/* One line of the processes file: "<gpu> <pid> <bytes> [<gi> <ci>]" (a compute
 * process) or "graphics <gpu> <pid> <bytes>".  0: a record, 1: blank or a
 * comment, -1: malformed. */
static int parse_process_line(char *line, struct process_line *out)
{
    char *tokens[8], *save = NULL;
    unsigned int n = 0;
    unsigned long long gpu, pid, gi = MOCK_NO_INSTANCE, ci = MOCK_NO_INSTANCE, used = MOCK_NOT_AVAILABLE;

    for (char *token = strtok_r(line, " \t\r\n", &save); token != NULL && n < 8; token = strtok_r(NULL, " \t\r\n", &save))
        tokens[n++] = token;
    if (n == 0 || tokens[0][0] == '#')
        return 1;
    unsigned int first = 0;
    out->kind = MOCK_PROC_COMPUTE;
    if (strcmp(tokens[0], "graphics") == 0) {
        out->kind = MOCK_PROC_GRAPHICS;
        first = 1;
        if (n != 4)
            return -1;
    } else if (n != 3 && n != 5) {
        return -1;
    }
    if (parse_number(tokens[first], MOCK_MAX_GPUS - 1, &gpu) != 0 || parse_number(tokens[first + 1], INT_MAX, &pid) != 0 ||
        pid == 0)
        return -1;
    if (strcmp(tokens[first + 2], "-") != 0 && parse_number(tokens[first + 2], MOCK_NOT_AVAILABLE - 1, &used) != 0)
        return -1;
    if (n == 5 && (parse_number(tokens[3], MOCK_MAX_GPU_INSTANCE_ID, &gi) != 0 ||
                   parse_number(tokens[4], MOCK_MAX_COMPUTE_INSTANCE_ID, &ci) != 0))
        return -1;
    *out = (struct process_line){out->kind, (unsigned int)gpu, (unsigned int)pid, (unsigned int)gi, (unsigned int)ci,
                                 used};
    return 0;
}

/* The common body of nvmlDeviceGet{Compute,Graphics}RunningProcesses[_v2|_v3]:
 * the live processes the host's processes file lists for the device, written
 * as stride-byte records (v1 or v2 layout) into infos.  A GPU lists all of its
 * own; a MIG device those of its GPU with its gi and ci; the parent GPU of MIG
 * devices gives the aggregate only to a privileged caller, as NVML does.
 * Graphics contexts do not exist in MIG mode. */
static nvmlReturn_t running_processes(nvmlDevice_t device, int kind, unsigned int *infoCount, void *infos,
                                      size_t stride)
{
    nvmlReturn_t ret = check_device(device, infoCount);
    if (ret != NVML_SUCCESS)
        return ret;
    /* NULL infos only asks for the count (*infoCount == 0). */
    if (infos == NULL && *infoCount != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int gpu, gi = MOCK_NO_INSTANCE, ci = MOCK_NO_INSTANCE;
    if (device->is_mig) {
        if (kind == MOCK_PROC_GRAPHICS)
            return NVML_ERROR_NOT_SUPPORTED;
        pthread_mutex_lock(&g_mig_lock);
        refresh_state(0);
        int live = device->is_mig; /* a destroyed instance's handle is stale */
        gpu = device->parent;
        gi = device->gpu_instance_id;
        ci = device->compute_instance_id;
        pthread_mutex_unlock(&g_mig_lock);
        if (!live)
            return NVML_ERROR_INVALID_ARGUMENT;
    } else {
        gpu = device->index;
        if (device->mig_mode == MOCK_MIG_ENABLED && geteuid() != 0)
            return NVML_ERROR_NO_PERMISSION;
    }
    ensure_paths();
    /* Writers replace the file by rename, so one open reads one whole version. */
    FILE *file = g_processes_path[0] ? fopen(g_processes_path, "re") : NULL;
    if (file == NULL && g_processes_path[0] && errno != ENOENT) {
        fprintf(stderr, "mock-nvml: cannot read %s: %s\n", g_processes_path, strerror(errno));
        return NVML_ERROR_UNKNOWN;
    }
    unsigned int capacity = *infoCount, found = 0, lineno = 0;
    char line[256];
    while (file != NULL && fgets(line, sizeof line, file) != NULL) {
        struct process_line entry;
        lineno++;
        int parsed = parse_process_line(line, &entry);
        if (parsed < 0) {
            fprintf(stderr, "mock-nvml: %s:%u: malformed process line\n", g_processes_path, lineno);
            fclose(file);
            return NVML_ERROR_UNKNOWN;
        }
        if (parsed > 0 || entry.kind != kind || entry.gpu != gpu)
            continue;
        if (device->is_mig && (entry.gi != gi || entry.ci != ci))
            continue;
        if (!pid_alive(entry.pid))
            continue;
        if (found < capacity) {
            nvmlProcessInfo_v2_t info = {entry.pid, entry.used, entry.gi, entry.ci};
            memcpy((char *)infos + (size_t)found * stride, &info, stride);
        }
        found++;
    }
    if (file != NULL)
        fclose(file);
    *infoCount = found;
    return found > capacity ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_COMPUTE, infoCount, infos, sizeof *infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_v2_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_COMPUTE, infoCount, infos, sizeof *infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v1_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_COMPUTE, infoCount, infos, sizeof *infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                  nvmlProcessInfo_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_GRAPHICS, infoCount, infos, sizeof *infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                  nvmlProcessInfo_v2_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_GRAPHICS, infoCount, infos, sizeof *infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                               nvmlProcessInfo_v1_t *infos)
{
    COUNT_CALL();
    return running_processes(device, MOCK_PROC_GRAPHICS, infoCount, infos, sizeof *infos);
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
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    ret = NVML_ERROR_NOT_FOUND;
    if (index < device->mig_count) {
        *migDevice = &g_migdev_flat[device->migs[index]];
        ret = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&g_mig_lock);
    return ret;
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

/* ---- MIG management -------------------------------------------------------- */

/* A GPU in MIG mode: MIG calls on anything else are NOT_SUPPORTED, as nvml.h says. */
static nvmlReturn_t check_mig_gpu(nvmlDevice_t device, const void *out)
{
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && device->is_mig)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && device->mig_mode != MOCK_MIG_ENABLED)
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

/* A GPU that has MIG, in MIG mode or not: profile info is answered either way
 * (real NVML does: go-nvlib lists them on any GPU whose MIG mode reads). */
static nvmlReturn_t check_mig_capable_gpu(nvmlDevice_t device, const void *out)
{
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && device->is_mig)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && device->mig_mode == MOCK_MIG_NONE)
        ret = NVML_ERROR_NOT_SUPPORTED;
    return ret;
}

/* A handle this library handed out for an instance that still exists. */
static int valid_gi(nvmlGpuInstance_t gi)
{
    uintptr_t base = (uintptr_t)&g_gis[0][0], ptr = (uintptr_t)gi;
    return gi != NULL && ptr >= base && (ptr - base) % sizeof *gi == 0 &&
           (ptr - base) / sizeof *gi < (uintptr_t)(MOCK_MAX_GPUS * MOCK_GI_IDS) && gi->live;
}

static int valid_ci(nvmlComputeInstance_t ci)
{
    uintptr_t base = (uintptr_t)&g_cis[0][0][0], ptr = (uintptr_t)ci;
    return ci != NULL && ptr >= base && (ptr - base) % sizeof *ci == 0 &&
           (ptr - base) / sizeof *ci < (uintptr_t)(MOCK_MAX_GPUS * MOCK_GI_IDS * MOCK_CI_IDS) && ci->live;
}

/* The NVML profile index of the driver profile id on a GPU, or -1. */
static int profile_by_id(unsigned int gpu, unsigned int id)
{
    for (int index = 0; index < MOCK_GI_PROFILE_COUNT; index++)
        if (g_topo.profiles[gpu][index].present && g_topo.profiles[gpu][index].id == id)
            return index;
    return -1;
}

/* Memory slices the live GIs of a GPU occupy, as a bitmask. */
static unsigned int taken_slices(unsigned int gpu)
{
    unsigned int taken = 0;
    for (unsigned int id = 0; id < MOCK_GI_IDS; id++) {
        const struct nvmlGpuInstance_st *gi = &g_gis[gpu][id];
        if (gi->live)
            taken |= ((1u << gi->size) - 1) << gi->start;
    }
    return taken;
}

/* Why a GI of profile index could not go anywhere (or at start, when start >= 0):
 * NVML_SUCCESS with *chosen set when it can.  Besides free memory slices the
 * driver keeps to the profile's instance count, the GPU's compute slices and
 * its one set of media engines (OFA: +me and 7g). */
static nvmlReturn_t find_gi_placement(unsigned int gpu, int index, int start, unsigned int *chosen)
{
    const struct gi_profile *p = &g_topo.profiles[gpu][index];
    unsigned int count = 0, compute = 0, ofa = 0, max_ofa = 0;
    for (int i = 0; i < MOCK_GI_PROFILE_COUNT; i++)
        if (g_topo.profiles[gpu][i].present && g_topo.profiles[gpu][i].ofas > max_ofa)
            max_ofa = g_topo.profiles[gpu][i].ofas;
    for (unsigned int id = 0; id < MOCK_GI_IDS; id++) {
        const struct nvmlGpuInstance_st *gi = &g_gis[gpu][id];
        const struct gi_profile *q = gi_profile_of(gi);
        if (!gi->live)
            continue;
        count += gi->profile == index;
        compute += q != NULL ? q->slices : 1;
        ofa += q != NULL ? q->ofas : 0;
    }
    if (count >= p->instances || compute + p->slices > MOCK_COMPUTE_SLICES || ofa + p->ofas > max_ofa)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int taken = taken_slices(gpu), mask = (1u << p->memory_slices) - 1;
    for (unsigned int s = 0; s < MOCK_MEMORY_SLICES; s++) {
        if (!(p->starts & (1u << s)) || (start >= 0 && (unsigned int)start != s))
            continue;
        if (!(taken & (mask << s)) && !g_gis[gpu][gi_id_of(s, p->memory_slices)].live) {
            *chosen = s;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_mig_capable_gpu(device, info);
    if (ret != NVML_SUCCESS)
        return ret;
    if (profile >= MOCK_GI_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct gi_profile *p = &g_topo.profiles[device->index][profile];
    if (!p->present)
        return NVML_ERROR_NOT_SUPPORTED;
    *info = (nvmlGpuInstanceProfileInfo_t){p->id, 0, p->slices, p->instances, p->sms, p->copy_engines,
                                           p->decoders, p->encoders, p->jpegs, p->ofas, p->memory_mb};
    return NVML_SUCCESS;
}

/* The versioned form: info->version says v2 or v3, as the caller stamped it. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                              nvmlGpuInstanceProfileInfo_v2_t *info)
{
    nvmlGpuInstanceProfileInfo_t v1;
    nvmlReturn_t ret = check_device(device, info);
    if (ret != NVML_SUCCESS) {
        COUNT_CALL();
        return ret;
    }
    if (info->version != nvmlGpuInstanceProfileInfo_v2 && info->version != nvmlGpuInstanceProfileInfo_v3) {
        COUNT_CALL();
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    /* One NVML call, not two: the v1 call below counts it. */
    ret = nvmlDeviceGetGpuInstanceProfileInfo(device, profile, &v1);
    if (ret != NVML_SUCCESS)
        return ret;
    const struct gi_profile *p = &g_topo.profiles[device->index][profile];
    if (info->version == nvmlGpuInstanceProfileInfo_v2) {
        unsigned int version = info->version;
        memset(info, 0, sizeof *info);
        *info = (nvmlGpuInstanceProfileInfo_v2_t){version, v1.id, 0, v1.sliceCount, v1.instanceCount,
                                                  v1.multiprocessorCount, v1.copyEngineCount, v1.decoderCount,
                                                  v1.encoderCount, v1.jpegCount, v1.ofaCount, v1.memorySizeMB, ""};
        snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    } else {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        unsigned int version = v3->version;
        memset(v3, 0, sizeof *v3);
        *v3 = (nvmlGpuInstanceProfileInfo_v3_t){version, v1.id, v1.sliceCount, v1.instanceCount,
                                                v1.multiprocessorCount, v1.copyEngineCount, v1.decoderCount,
                                                v1.encoderCount, v1.jpegCount, v1.ofaCount, v1.memorySizeMB, "", 0};
        snprintf(v3->name, sizeof v3->name, "MIG %s", p->name);
    }
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                       nvmlGpuInstancePlacement_t *placements,
                                                                       unsigned int *count)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_mig_gpu(device, count);
    if (ret != NVML_SUCCESS)
        return ret;
    int index = profile_by_id(device->index, profileId);
    if (index < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct gi_profile *p = &g_topo.profiles[device->index][index];
    /* Every legal placement, free or not (nvml.h); NULL placements asks for the count. */
    unsigned int n = 0;
    for (unsigned int s = 0; s < MOCK_MEMORY_SLICES; s++) {
        if (!(p->starts & (1u << s)))
            continue;
        if (placements != NULL)
            placements[n] = (nvmlGpuInstancePlacement_t){s, p->memory_slices};
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                                   unsigned int *count)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_mig_gpu(device, count);
    if (ret != NVML_SUCCESS)
        return ret;
    int index = profile_by_id(device->index, profileId);
    if (index < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    /* How many more fit: place them one by one on a scratch copy of the GPU's GIs. */
    struct nvmlGpuInstance_st saved[MOCK_GI_IDS];
    memcpy(saved, g_gis[device->index], sizeof saved);
    unsigned int n = 0, start;
    while (find_gi_placement(device->index, index, -1, &start) == NVML_SUCCESS) {
        unsigned int size = g_topo.profiles[device->index][index].memory_slices;
        g_gis[device->index][gi_id_of(start, size)] =
            (struct nvmlGpuInstance_st){1, device->index, gi_id_of(start, size), index, start, size, 0};
        n++;
    }
    memcpy(g_gis[device->index], saved, sizeof saved);
    pthread_mutex_unlock(&g_mig_lock);
    *count = n;
    return NVML_SUCCESS;
}

/* Holds the host-wide change lock and re-reads the state; changes need root
 * like the real driver's (the mig/config capability is root's). */
static nvmlReturn_t begin_change(int *lock_fd)
{
    /* In the driver's view the process holds no mig/config capability. */
    if (geteuid() != 0 || g_driver_view)
        return NVML_ERROR_NO_PERMISSION;
    ensure_paths();
    int fd = g_state_lock_path[0] ? open(g_state_lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0)
        return NVML_ERROR_UNKNOWN;
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
            close(fd);
            return NVML_ERROR_UNKNOWN;
        }
    }
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(1);
    *lock_fd = fd;
    return NVML_SUCCESS;
}

static void end_change(int lock_fd)
{
    index_migdevs();
    pthread_mutex_unlock(&g_mig_lock);
    close(lock_fd); /* releases the flock */
}

static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, int start,
                              nvmlGpuInstance_t *gpuInstance)
{
    int lock_fd;
    nvmlReturn_t ret = check_mig_gpu(device, gpuInstance);
    if (ret != NVML_SUCCESS)
        return ret;
    int index = profile_by_id(device->index, profileId);
    if (index < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct gi_profile *p = &g_topo.profiles[device->index][index];
    if (start >= 0 && !(p->starts & (1u << start)))
        return NVML_ERROR_INVALID_ARGUMENT;
    ret = begin_change(&lock_fd);
    if (ret != NVML_SUCCESS)
        return ret;
    unsigned int chosen;
    ret = find_gi_placement(device->index, index, start, &chosen);
    if (ret == NVML_SUCCESS) {
        unsigned int id = gi_id_of(chosen, p->memory_slices);
        add_gi(device->index, id, index, chosen, p->memory_slices);
        if (caps_create(device->minor, id, -1) != 0 || write_state() != 0) {
            caps_remove(device->minor, id, -1);
            g_gis[device->index][id].live = 0;
            ret = NVML_ERROR_UNKNOWN;
        } else {
            *gpuInstance = &g_gis[device->index][id];
        }
    }
    end_change(lock_fd);
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                     nvmlGpuInstance_t *gpuInstance)
{
    COUNT_CALL();
    return create_gi(device, profileId, -1, gpuInstance);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                                  const nvmlGpuInstancePlacement_t *placement,
                                                                  nvmlGpuInstance_t *gpuInstance)
{
    COUNT_CALL();
    if (placement == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (check_mig_gpu(device, gpuInstance) == NVML_SUCCESS) {
        int index = profile_by_id(device->index, profileId);
        if (index >= 0 && (placement->start >= MOCK_MEMORY_SLICES ||
                           placement->size != g_topo.profiles[device->index][index].memory_slices))
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    return create_gi(device, profileId, placement->start >= MOCK_MEMORY_SLICES ? MOCK_MEMORY_SLICES : (int)placement->start,
                     gpuInstance);
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    int lock_fd;
    COUNT_CALL();
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t ret = begin_change(&lock_fd);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!valid_gi(gpuInstance)) {
        ret = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++)
            if (g_cis[gpuInstance->gpu][gpuInstance->id][ci].live)
                ret = NVML_ERROR_IN_USE;
    }
    if (ret == NVML_SUCCESS) {
        gpuInstance->live = 0;
        if (write_state() != 0) {
            gpuInstance->live = 1;
            ret = NVML_ERROR_UNKNOWN;
        } else {
            caps_remove(g_topo.devices[gpuInstance->gpu].minor, gpuInstance->id, -1);
        }
    }
    end_change(lock_fd);
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                                   nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_mig_gpu(device, count);
    if (ret == NVML_SUCCESS && gpuInstances == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    int index = profile_by_id(device->index, profileId);
    if (index < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    unsigned int n = 0;
    for (unsigned int id = 0; id < MOCK_GI_IDS; id++)
        if (g_gis[device->index][id].live && g_gis[device->index][id].profile == index)
            gpuInstances[n++] = &g_gis[device->index][id];
    pthread_mutex_unlock(&g_mig_lock);
    *count = n;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_mig_gpu(device, gpuInstance);
    if (ret != NVML_SUCCESS)
        return ret;
    if (id >= MOCK_GI_IDS)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    ret = g_gis[device->index][id].live ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
    if (ret == NVML_SUCCESS)
        *gpuInstance = &g_gis[device->index][id];
    pthread_mutex_unlock(&g_mig_lock);
    return ret;
}

/* Common prologue of calls on a GI handle: it must still exist. */
static nvmlReturn_t check_gi(nvmlGpuInstance_t gi, const void *out)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    int ok = valid_gi(gi);
    pthread_mutex_unlock(&g_mig_lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gi(gpuInstance, info);
    if (ret != NVML_SUCCESS)
        return ret;
    const struct gi_profile *p = gi_profile_of(gpuInstance);
    *info = (nvmlGpuInstanceInfo_t){&g_topo.devices[gpuInstance->gpu], gpuInstance->id,
                                    p != NULL ? p->id : 0xFFFFFFFFu, {gpuInstance->start, gpuInstance->size}};
    return NVML_SUCCESS;
}

static nvmlReturn_t ci_profile_info(nvmlGpuInstance_t gi, unsigned int profile, unsigned int engProfile,
                                    nvmlComputeInstanceProfileInfo_t *info)
{
    nvmlReturn_t ret = check_gi(gi, info);
    if (ret != NVML_SUCCESS)
        return ret;
    /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED is the only engine profile. */
    if (profile >= MOCK_CI_PROFILE_COUNT || engProfile != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct gi_profile *p = gi_profile_of(gi);
    if (p == NULL || !ci_profile_fits(profile, p->slices))
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned int s = ci_profile_slices(profile);
    *info = (nvmlComputeInstanceProfileInfo_t){profile, s, p->slices / s, p->sms / p->slices * s,
                                               p->copy_engines, p->decoders, p->encoders, p->jpegs, p->ofas};
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profile, unsigned int engProfile,
                                                                       nvmlComputeInstanceProfileInfo_t *info)
{
    COUNT_CALL();
    return ci_profile_info(gpuInstance, profile, engProfile, info);
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance,
                                                                        unsigned int profile, unsigned int engProfile,
                                                                        nvmlComputeInstanceProfileInfo_v2_t *info)
{
    nvmlComputeInstanceProfileInfo_t v1;
    char name[MOCK_PROFILE_NAME_SIZE + 8];
    COUNT_CALL();
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlComputeInstanceProfileInfo_v2 && info->version != nvmlComputeInstanceProfileInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t ret = ci_profile_info(gpuInstance, profile, engProfile, &v1);
    if (ret != NVML_SUCCESS)
        return ret;
    ci_name(gpuInstance, profile, name, sizeof name);
    unsigned int version = info->version;
    if (version == nvmlComputeInstanceProfileInfo_v2) {
        memset(info, 0, sizeof *info);
        *info = (nvmlComputeInstanceProfileInfo_v2_t){version, v1.id, v1.sliceCount, v1.instanceCount,
                                                      v1.multiprocessorCount, v1.sharedCopyEngineCount,
                                                      v1.sharedDecoderCount, v1.sharedEncoderCount,
                                                      v1.sharedJpegCount, v1.sharedOfaCount, ""};
        snprintf(info->name, sizeof info->name, "MIG %s", name);
    } else {
        nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)(void *)info;
        memset(v3, 0, sizeof *v3);
        *v3 = (nvmlComputeInstanceProfileInfo_v3_t){version, v1.id, v1.sliceCount, v1.instanceCount,
                                                    v1.multiprocessorCount, v1.sharedCopyEngineCount,
                                                    v1.sharedDecoderCount, v1.sharedEncoderCount,
                                                    v1.sharedJpegCount, v1.sharedOfaCount, "", 0};
        snprintf(v3->name, sizeof v3->name, "MIG %s", name);
    }
    return NVML_SUCCESS;
}

/* The lowest free start (in the GI's compute slices) for a CI of profile, or -1. */
static int find_ci_start(const struct nvmlGpuInstance_st *gi, unsigned int profile)
{
    const struct gi_profile *p = gi_profile_of(gi);
    unsigned int s = ci_profile_slices(profile), taken = 0;
    for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++) {
        const struct nvmlComputeInstance_st *c = &g_cis[gi->gpu][gi->id][ci];
        if (c->live)
            taken |= ((1u << c->size) - 1) << c->start;
    }
    for (unsigned int start = 0; p != NULL && start + s <= p->slices; start += s)
        if (!(taken & (((1u << s) - 1) << start)))
            return (int)start;
    return -1;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                            unsigned int profileId,
                                                                            unsigned int *count)
{
    nvmlComputeInstanceProfileInfo_t info;
    COUNT_CALL();
    nvmlReturn_t ret = ci_profile_info(gpuInstance, profileId, 0, &info);
    if (ret != NVML_SUCCESS || count == NULL)
        return ret != NVML_SUCCESS ? ret : NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    unsigned int s = ci_profile_slices(profileId), taken = 0, n = 0;
    for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++) {
        const struct nvmlComputeInstance_st *c = &g_cis[gpuInstance->gpu][gpuInstance->id][ci];
        if (c->live)
            taken |= ((1u << c->size) - 1) << c->start;
    }
    for (unsigned int start = 0; start + s <= info.sliceCount * info.instanceCount; start += s)
        n += !(taken & (((1u << s) - 1) << start));
    pthread_mutex_unlock(&g_mig_lock);
    *count = n;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                              nvmlComputeInstance_t *computeInstance)
{
    nvmlComputeInstanceProfileInfo_t info;
    int lock_fd;
    COUNT_CALL();
    if (computeInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = ci_profile_info(gpuInstance, profileId, 0, &info);
    if (ret == NVML_ERROR_NOT_SUPPORTED)
        ret = NVML_ERROR_INVALID_ARGUMENT; /* a CI profile this GI does not offer */
    if (ret != NVML_SUCCESS)
        return ret;
    ret = begin_change(&lock_fd);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!valid_gi(gpuInstance)) {
        end_change(lock_fd);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    int start = find_ci_start(gpuInstance, profileId);
    unsigned int id = 0;
    while (id < MOCK_CI_IDS && g_cis[gpuInstance->gpu][gpuInstance->id][id].live)
        id++;
    if (start < 0 || id >= MOCK_CI_IDS) {
        ret = NVML_ERROR_INSUFFICIENT_RESOURCES;
    } else {
        add_ci(gpuInstance->gpu, gpuInstance->id, id, profileId, (unsigned int)start);
        unsigned int minor = g_topo.devices[gpuInstance->gpu].minor;
        if (caps_create(minor, gpuInstance->id, (int)id) != 0 || write_state() != 0) {
            caps_remove(minor, gpuInstance->id, (int)id);
            g_cis[gpuInstance->gpu][gpuInstance->id][id].live = 0;
            ret = NVML_ERROR_UNKNOWN;
        } else {
            *computeInstance = &g_cis[gpuInstance->gpu][gpuInstance->id][id];
        }
    }
    end_change(lock_fd);
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    int lock_fd;
    COUNT_CALL();
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t ret = begin_change(&lock_fd);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!valid_ci(computeInstance)) {
        ret = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        computeInstance->live = 0;
        if (write_state() != 0) {
            computeInstance->live = 1;
            ret = NVML_ERROR_UNKNOWN;
        } else {
            caps_remove(g_topo.devices[computeInstance->gpu].minor, computeInstance->gi, (int)computeInstance->id);
        }
    }
    end_change(lock_fd);
    return ret;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                            nvmlComputeInstance_t *computeInstances,
                                                            unsigned int *count)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gi(gpuInstance, count);
    if (ret == NVML_SUCCESS && (computeInstances == NULL || profileId >= MOCK_CI_PROFILE_COUNT))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    pthread_mutex_lock(&g_mig_lock);
    unsigned int n = 0;
    for (unsigned int ci = 0; ci < MOCK_CI_IDS; ci++) {
        struct nvmlComputeInstance_st *c = &g_cis[gpuInstance->gpu][gpuInstance->id][ci];
        if (c->live && c->profile == profileId)
            computeInstances[n++] = c;
    }
    pthread_mutex_unlock(&g_mig_lock);
    *count = n;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                               nvmlComputeInstance_t *computeInstance)
{
    COUNT_CALL();
    nvmlReturn_t ret = check_gi(gpuInstance, computeInstance);
    if (ret == NVML_SUCCESS && id >= MOCK_CI_IDS)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    struct nvmlComputeInstance_st *c = &g_cis[gpuInstance->gpu][gpuInstance->id][id];
    if (!c->live)
        return NVML_ERROR_NOT_FOUND;
    *computeInstance = c;
    return NVML_SUCCESS;
}

static nvmlReturn_t ci_info(nvmlComputeInstance_t ci, nvmlComputeInstanceInfo_t *info)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mig_lock);
    refresh_state(0);
    int ok = valid_ci(ci);
    pthread_mutex_unlock(&g_mig_lock);
    if (!ok)
        return NVML_ERROR_INVALID_ARGUMENT;
    *info = (nvmlComputeInstanceInfo_t){&g_topo.devices[ci->gpu], &g_gis[ci->gpu][ci->gi], ci->id, ci->profile,
                                        {ci->start, ci->size}};
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                       nvmlComputeInstanceInfo_t *info)
{
    COUNT_CALL();
    return ci_info(computeInstance, info);
}

NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                    nvmlComputeInstanceInfo_t *info)
{
    COUNT_CALL();
    return ci_info(computeInstance, info);
}
