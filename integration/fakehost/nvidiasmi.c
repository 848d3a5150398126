/*
 * nvidiasmi.c - nvidia-smi on the simulated GPU host that integration/fakehost
 * builds: a real NVML client, like NVIDIA's, of whatever libnvidia-ml.so.1 it
 * loads, so it shows what the calling process may use and nothing else.
 *
 * Library lookup: run from a simulated host's directory (its real path is
 * <root>/usr/bin/nvidia-smi with <root> not "/") it loads
 * <root>/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1, that host's mock NVML;
 * at /usr/bin/nvidia-smi (inside a container gpuhook injected it into, or a
 * chroot) it dlopen()s "libnvidia-ml.so.1" by name, as the real one does,
 * found through the ld.so.cache: the library gpuhook injected.
 *
 * Supported: no arguments (the version table, one row per GPU), -L /
 * --list-gpus (GPUs and their MIG devices), --version, -h / --help, and
 * --query-gpu=FIELD[,FIELD...] --format=csv[,noheader][,nounits].  Exit codes
 * are nvidia-smi's: 0, the NVML error of a failed init (9: driver not loaded,
 * 18: version mismatch), 6 when no GPU is visible, 12 without the library,
 * 2 for arguments it does not know.  Messages go to stdout, as nvidia-smi's do.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define EXIT_USAGE 2
#define EXIT_NO_DEVICES 6

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

/* The NVML entry points used, resolved by name from the loaded library. */
static struct {
    nvmlReturn_t (*init)(void);
    nvmlReturn_t (*shutdown)(void);
    const char *(*error_string)(nvmlReturn_t);
    nvmlReturn_t (*driver_version)(char *, unsigned int);
    nvmlReturn_t (*nvml_version)(char *, unsigned int);
    nvmlReturn_t (*cuda_version)(int *);
    nvmlReturn_t (*count)(unsigned int *);
    nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t *);
    nvmlReturn_t (*name)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*pci)(nvmlDevice_t, nvmlPciInfo_t *);
    nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t *);
    nvmlReturn_t (*persistence)(nvmlDevice_t, int *);
    nvmlReturn_t (*mig_mode)(nvmlDevice_t, unsigned int *, unsigned int *);
    nvmlReturn_t (*max_migs)(nvmlDevice_t, unsigned int *);
    nvmlReturn_t (*mig_by_index)(nvmlDevice_t, unsigned int, nvmlDevice_t *);
} nvml;

struct gpu {
    unsigned int index;
    char name[96];
    char uuid[96];
    char bus_id[32];
    unsigned long long memory_total, memory_used;
    int persistence;
};

/* Loads libnvidia-ml.so.1 (see the header); NULL when there is none. */
static void *open_nvml(void)
{
    char exe[PATH_MAX], path[PATH_MAX + 64];
    if (realpath("/proc/self/exe", exe) != NULL) {
        for (int up = 0; up < 3; up++) {
            char *slash = strrchr(exe, '/');
            if (slash == NULL)
                break;
            *slash = '\0';
        }
        /* A simulated host's directory is not in this machine's ld.so.cache: name its library. */
        if (exe[0] != '\0') {
            snprintf(path, sizeof path, "%s/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", exe);
            return dlopen(path, RTLD_NOW);
        }
    }
    return dlopen("libnvidia-ml.so.1", RTLD_NOW);
}

/* Resolves every entry point; 0 when one is missing. */
static int resolve(void *lib)
{
#define SYM(field, name) (*(void **)&nvml.field = dlsym(lib, name)) != NULL
    return SYM(init, "nvmlInit_v2") && SYM(shutdown, "nvmlShutdown") && SYM(error_string, "nvmlErrorString") &&
           SYM(driver_version, "nvmlSystemGetDriverVersion") && SYM(nvml_version, "nvmlSystemGetNVMLVersion") &&
           SYM(cuda_version, "nvmlSystemGetCudaDriverVersion_v2") && SYM(count, "nvmlDeviceGetCount_v2") &&
           SYM(by_index, "nvmlDeviceGetHandleByIndex_v2") && SYM(name, "nvmlDeviceGetName") &&
           SYM(uuid, "nvmlDeviceGetUUID") && SYM(pci, "nvmlDeviceGetPciInfo_v3") &&
           SYM(memory, "nvmlDeviceGetMemoryInfo") && SYM(persistence, "nvmlDeviceGetPersistenceMode") &&
           SYM(mig_mode, "nvmlDeviceGetMigMode") && SYM(max_migs, "nvmlDeviceGetMaxMigDeviceCount") &&
           SYM(mig_by_index, "nvmlDeviceGetMigDeviceHandleByIndex");
#undef SYM
}

/* Loads and initialises NVML, printing nvidia-smi's message on failure; returns the exit status. */
static int start(void)
{
    void *lib = open_nvml();
    if (lib == NULL) {
        printf("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
               "NVIDIA Display Driver is properly installed and present in your system.\n"
               "Please also try adding directory that contains libnvidia-ml.so to your system PATH.\n");
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    }
    if (!resolve(lib)) {
        printf("Failed to initialize NVML: Function Not Found\n");
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    }
    nvmlReturn_t ret = nvml.init();
    if (ret == NVML_ERROR_DRIVER_NOT_LOADED) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
               "the latest NVIDIA driver is installed and running.\n\n");
        return ret;
    }
    if (ret == NVML_ERROR_LIB_RM_VERSION_MISMATCH) {
        printf("Failed to initialize NVML: Driver/library version mismatch\n");
        return ret;
    }
    if (ret != NVML_SUCCESS) {
        printf("Failed to initialize NVML: %s\n", nvml.error_string(ret));
        return ret;
    }
    return 0;
}

/* Reads GPU index into *gpu; the NVML error otherwise. */
static nvmlReturn_t read_gpu(unsigned int index, struct gpu *gpu, nvmlDevice_t *device)
{
    nvmlPciInfo_t pci;
    nvmlMemory_t memory;
    nvmlReturn_t ret = nvml.by_index(index, device);
    if (ret == NVML_SUCCESS)
        ret = nvml.name(*device, gpu->name, sizeof gpu->name);
    if (ret == NVML_SUCCESS)
        ret = nvml.uuid(*device, gpu->uuid, sizeof gpu->uuid);
    if (ret == NVML_SUCCESS)
        ret = nvml.pci(*device, &pci);
    if (ret == NVML_SUCCESS)
        ret = nvml.memory(*device, &memory);
    if (ret == NVML_SUCCESS && nvml.persistence(*device, &gpu->persistence) != NVML_SUCCESS)
        gpu->persistence = 0;
    if (ret != NVML_SUCCESS)
        return ret;
    gpu->index = index;
    snprintf(gpu->bus_id, sizeof gpu->bus_id, "%s", pci.busId);
    gpu->memory_total = memory.total;
    gpu->memory_used = memory.used;
    return NVML_SUCCESS;
}

/* The number of GPUs NVML shows, printing "No devices were found" (and returning 0) when none. */
static unsigned int gpu_count(void)
{
    unsigned int count = 0;
    if (nvml.count(&count) != NVML_SUCCESS || count == 0) {
        printf("No devices were found\n");
        return 0;
    }
    return count;
}

static int fail(nvmlReturn_t ret)
{
    printf("Unable to query the GPUs: %s\n", nvml.error_string(ret));
    return ret;
}

/* The default output: versions, then two rows per GPU (the layout of the real 550-series table). */
static int show_table(void)
{
    static const char rule[] = "+-----------------------------------------+------------------------+----------------------+";
    char driver[80], cuda[16], used[64];
    int cuda_version = 0;
    if (nvml.driver_version(driver, sizeof driver) != NVML_SUCCESS || nvml.cuda_version(&cuda_version) != NVML_SUCCESS)
        return fail(NVML_ERROR_INVALID_ARGUMENT);
    snprintf(cuda, sizeof cuda, "%d.%d", cuda_version / 1000, cuda_version % 1000 / 10);
    unsigned int count = gpu_count();
    if (count == 0)
        return EXIT_NO_DEVICES;
    printf("+");
    for (size_t i = 2; i < sizeof rule - 1; i++)
        putchar('-');
    printf("+\n");
    printf("| NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %-9s|\n", driver, driver, cuda);
    printf("|-----------------------------------------+------------------------+----------------------+\n");
    printf("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n");
    printf("| %-39s | %22s | %20s |\n", "Fan  Temp   Perf          Pwr:Usage/Cap", "Memory-Usage", "GPU-Util  Compute M.");
    printf("|=========================================+========================+======================|\n");
    for (unsigned int i = 0; i < count; i++) {
        struct gpu gpu;
        nvmlDevice_t device;
        nvmlReturn_t ret = read_gpu(i, &gpu, &device);
        if (ret != NVML_SUCCESS)
            return fail(ret);
        char name[29];
        if (strlen(gpu.name) <= 28)
            snprintf(name, sizeof name, "%s", gpu.name);
        else
            snprintf(name, sizeof name, "%.25s...", gpu.name);
        printf("| %3u  %-28s%5s  |   %s Off |%21d |\n", gpu.index, name, gpu.persistence ? "On" : "Off", gpu.bus_id, 0);
        snprintf(used, sizeof used, "%lluMiB / %lluMiB", gpu.memory_used >> 20, gpu.memory_total >> 20);
        printf("| %-16s%23s | %22s | %20s |\n", "N/A   N/A    P0", "N/A /  N/A", used, "0%      Default");
        printf("%s\n", rule);
    }
    return 0;
}

/* The profile part of a MIG device's name ("NVIDIA H100 80GB HBM3 MIG 3g.40gb" -> "3g.40gb"). */
static const char *mig_profile(const char *name)
{
    const char *at = strstr(name, " MIG ");
    return at != NULL ? at + 5 : name;
}

/* -L: each GPU, its MIG devices indented under it. */
static int list_gpus(void)
{
    unsigned int count = gpu_count();
    if (count == 0)
        return EXIT_NO_DEVICES;
    for (unsigned int i = 0; i < count; i++) {
        struct gpu gpu;
        nvmlDevice_t device;
        unsigned int current, pending, max = 0;
        nvmlReturn_t ret = read_gpu(i, &gpu, &device);
        if (ret != NVML_SUCCESS)
            return fail(ret);
        printf("GPU %u: %s (UUID: %s)\n", gpu.index, gpu.name, gpu.uuid);
        if (nvml.mig_mode(device, &current, &pending) != NVML_SUCCESS || current != 1 ||
            nvml.max_migs(device, &max) != NVML_SUCCESS)
            continue;
        for (unsigned int m = 0; m < max; m++) {
            nvmlDevice_t mig;
            char name[96], uuid[96];
            if (nvml.mig_by_index(device, m, &mig) != NVML_SUCCESS || nvml.name(mig, name, sizeof name) != NVML_SUCCESS ||
                nvml.uuid(mig, uuid, sizeof uuid) != NVML_SUCCESS)
                continue;
            printf("  MIG %-11s Device %2u: (UUID: %s)\n", mig_profile(name), m, uuid);
        }
    }
    return 0;
}

static int show_version(void)
{
    char driver[80], version[80];
    int cuda = 0;
    if (nvml.driver_version(driver, sizeof driver) != NVML_SUCCESS || nvml.nvml_version(version, sizeof version) != NVML_SUCCESS ||
        nvml.cuda_version(&cuda) != NVML_SUCCESS)
        return fail(NVML_ERROR_INVALID_ARGUMENT);
    printf("NVIDIA-SMI version  : %s\nNVML version        : %s\nDRIVER version      : %s\nCUDA Version        : %d.%d\n",
           driver, version, driver, cuda / 1000, cuda % 1000 / 10);
    return 0;
}

/* One --query-gpu field: its header (with unit) and value; 0 if the field is unknown. */
static int query_field(const char *field, const struct gpu *gpu, unsigned int count, int units, char *header,
                       char *value, size_t size)
{
    const char *mib = units ? " MiB" : "";
    snprintf(header, size, "%s", field);
    if (strcmp(field, "index") == 0)
        snprintf(value, size, "%u", gpu->index);
    else if (strcmp(field, "name") == 0 || strcmp(field, "gpu_name") == 0)
        snprintf(value, size, "%s", gpu->name);
    else if (strcmp(field, "uuid") == 0 || strcmp(field, "gpu_uuid") == 0)
        snprintf(value, size, "%s", gpu->uuid);
    else if (strcmp(field, "pci.bus_id") == 0 || strcmp(field, "gpu_bus_id") == 0)
        snprintf(value, size, "%s", gpu->bus_id);
    else if (strcmp(field, "count") == 0)
        snprintf(value, size, "%u", count);
    else if (strcmp(field, "persistence_mode") == 0)
        snprintf(value, size, "%s", gpu->persistence ? "Enabled" : "Disabled");
    else if (strcmp(field, "memory.total") == 0 || strcmp(field, "memory.used") == 0 ||
             strcmp(field, "memory.free") == 0) {
        unsigned long long total = gpu->memory_total >> 20, used = gpu->memory_used >> 20;
        unsigned long long mb = field[7] == 't' ? total : field[7] == 'u' ? used : total - used;
        snprintf(header, size, "%s [MiB]", field);
        snprintf(value, size, "%llu%s", mb, mib);
    } else if (strcmp(field, "driver_version") == 0) {
        if (nvml.driver_version(value, (unsigned int)size) != NVML_SUCCESS)
            snprintf(value, size, "[N/A]");
    } else
        return 0;
    return 1;
}

/* --query-gpu=FIELDS --format=csv[,noheader][,nounits]. */
static int query_gpus(const char *fields, const char *format)
{
    char header[64], value[128], copy[512];
    int noheader = 0, units = 1;

    if (format == NULL || strncmp(format, "csv", 3) != 0 || (format[3] != '\0' && format[3] != ',')) {
        printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n");
        return EXIT_USAGE;
    }
    snprintf(copy, sizeof copy, "%s", format);
    for (char *opt = strtok(copy, ","); opt != NULL; opt = strtok(NULL, ",")) {
        if (strcmp(opt, "noheader") == 0)
            noheader = 1;
        else if (strcmp(opt, "nounits") == 0)
            units = 0;
        else if (strcmp(opt, "csv") != 0) {
            printf("\"%s\" is not a valid format option.\n", opt);
            return EXIT_USAGE;
        }
    }
    unsigned int count = gpu_count();
    if (count == 0)
        return EXIT_NO_DEVICES;
    for (int row = noheader ? 0 : -1; row < (int)count; row++) {
        struct gpu gpu;
        nvmlDevice_t device;
        memset(&gpu, 0, sizeof gpu);
        if (row >= 0) {
            nvmlReturn_t ret = read_gpu((unsigned int)row, &gpu, &device);
            if (ret != NVML_SUCCESS)
                return fail(ret);
        }
        snprintf(copy, sizeof copy, "%s", fields);
        const char *sep = "";
        for (char *field = strtok(copy, ","); field != NULL; field = strtok(NULL, ",")) {
            while (*field == ' ')
                field++;
            if (!query_field(field, &gpu, count, units, header, value, sizeof value)) {
                printf("Field \"%s\" is not a valid field to query.\n\n", field);
                return EXIT_USAGE;
            }
            printf("%s%s", sep, row < 0 ? header : value);
            sep = ", ";
        }
        printf("\n");
    }
    return 0;
}

static void usage(void)
{
    printf("NVIDIA System Management Interface -- simulated GPU host (gpuhook integration/fakehost)\n\n"
           "    nvidia-smi                 the version table, one row per GPU\n"
           "    nvidia-smi -L              list the GPUs and their MIG devices\n"
           "    nvidia-smi --version       driver, NVML and CUDA versions\n"
           "    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total --format=csv[,noheader][,nounits]\n");
}

int main(int argc, char **argv)
{
    const char *query = NULL, *format = NULL;
    enum { TABLE, LIST, VERSION, QUERY } what = TABLE;

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "-L") == 0 || strcmp(arg, "--list-gpus") == 0)
            what = LIST;
        else if (strcmp(arg, "--version") == 0)
            what = VERSION;
        else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage();
            return 0;
        } else if (strncmp(arg, "--query-gpu=", 12) == 0) {
            what = QUERY;
            query = arg + 12;
        } else if (strncmp(arg, "--format=", 9) == 0)
            format = arg + 9;
        else {
            printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n");
            return EXIT_USAGE;
        }
    }
    int status = start();
    if (status != 0)
        return status;
    switch (what) {
    case LIST: status = list_gpus(); break;
    case VERSION: status = show_version(); break;
    case QUERY: status = query_gpus(query, format); break;
    default: status = show_table(); break;
    }
    nvml.shutdown();
    fflush(stdout);
    return status;
}
