/*
 * modprobe.c - nvidia-modprobe on the simulated GPU host that
 * integration/fakehost builds, with the real tool's interface.
 *
 * The real nvidia-modprobe loads NVIDIA's kernel modules and makes their
 * device nodes.  There are no modules here (every module "is loaded":
 * <root>/proc/devices lists their majors), so this one only makes the nodes,
 * under <root>/dev, where <root> is three directories above its own real path
 * (<root>/usr/bin/nvidia-modprobe; "/" in a chroot), with the majors
 * <root>/proc/devices gives and the modes the builder uses:
 *     -c N, --create-nvidia-device-file=N   /dev/nvidiaN (N = 255: /dev/nvidiactl), 0666
 *     -u -c N, --unified-memory             /dev/nvidia-uvm and /dev/nvidia-uvm-tools, 0666
 *     -m -c N, --modeset                    /dev/nvidia-modeset (195:254), 0666
 *     -f PATH, --nvlink-capability-device-file=PATH (also --nvidia-capability-device-file)
 *                                           /dev/nvidia-caps/nvidia-cap<DeviceFileMinor> of the
 *                                           capability file <root>PATH, mode DeviceFileMode
 * (-c=N and -cN are accepted too; -u or -m alone "load the module" and make
 * nothing).  A node already right is left; a wrong one is replaced.  Needs
 * root, as the real one (setuid root) does.  Exit 0 on success, 1 with a
 * message on stderr on failure, 2 on an unknown option.
 *
 * For tests: every call appends its argv, tab-separated, to
 *     <root>/etc/mock-nvml/modprobe.log
 * and while <root>/etc/mock-nvml/modprobe-broken exists the call fails (exit
 * 1) with that file's first line as its message (FakeHost.break_modprobe).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#ifndef DRIVER_VERSION
#define DRIVER_VERSION "unknown"
#endif
#define NVIDIA_MAJOR 195 /* fixed, as modprobe-utils' NV_MAJOR_DEVICE_NUMBER */
#define CTL_MINOR 255
#define MODESET_MINOR 254
#define MAX_MINORS 64
#define CAPS_PREFIX "/proc/driver/nvidia/capabilities/"

static char g_root[PATH_MAX]; /* "" stands for "/" */

static int failure(const char *fmt, const char *what, const char *why)
{
    fprintf(stderr, "nvidia-modprobe: ");
    fprintf(stderr, fmt, what, why);
    fputc('\n', stderr);
    return 1;
}

/* <root> from /proc/self/exe, three directories up. */
static int find_root(void)
{
    char exe[PATH_MAX];
    if (realpath("/proc/self/exe", exe) == NULL)
        return -1;
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(exe, '/');
        if (slash == NULL)
            return -1;
        *slash = '\0';
    }
    snprintf(g_root, sizeof g_root, "%s", exe);
    return 0;
}

/* Appends argv to modprobe.log in one write, so concurrent calls never interleave. */
static void log_call(int argc, char **argv)
{
    char path[PATH_MAX + 64], line[8192];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/etc/mock-nvml/modprobe.log", g_root);
    for (int i = 0; i < argc && len < sizeof line - 2; i++) {
        int n = snprintf(line + len, sizeof line - 1 - len, "%s%s", i ? "\t" : "", argv[i]);
        if (n < 0)
            return;
        len = (size_t)n >= sizeof line - 1 - len ? sizeof line - 2 : len + (size_t)n;
    }
    line[len++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, line, len) != (ssize_t)len)
        fprintf(stderr, "nvidia-modprobe: short write to %s\n", path);
    close(fd);
}

/* The break_modprobe() message, or NULL when the stand-in is not broken. */
static const char *broken(void)
{
    static char message[512];
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/etc/mock-nvml/modprobe-broken", g_root);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return NULL;
    if (fgets(message, sizeof message, file) == NULL)
        snprintf(message, sizeof message, "failed (simulated)");
    fclose(file);
    message[strcspn(message, "\n")] = '\0';
    return message;
}

/* The major <root>/proc/devices gives the character device name, or -1. */
static long proc_major(const char *name)
{
    char path[PATH_MAX + 32], line[128], listed[96];
    long major = -1, number;
    int chars = 0;
    snprintf(path, sizeof path, "%s/proc/devices", g_root);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return -1;
    while (major < 0 && fgets(line, sizeof line, file) != NULL) {
        if (strncmp(line, "Character devices:", 18) == 0)
            chars = 1;
        else if (strncmp(line, "Block devices:", 14) == 0)
            chars = 0;
        else if (chars && sscanf(line, " %ld %95s", &number, listed) == 2 && strcmp(listed, name) == 0)
            major = number;
    }
    fclose(file);
    return major;
}

/* Makes <root>/dev/rel (c major:minor, mode), leaving a right one alone. */
static int make_node(const char *rel, long major, long minor, mode_t mode)
{
    char path[PATH_MAX + 64], dir[PATH_MAX + 64];
    struct stat st;
    dev_t dev = makedev((unsigned int)major, (unsigned int)minor);

    snprintf(path, sizeof path, "%s/dev/%s", g_root, rel);
    snprintf(dir, sizeof dir, "%s", path);
    *strrchr(dir, '/') = '\0';
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return failure("cannot create %s: %s", dir, strerror(errno));
    if (lstat(path, &st) == 0) {
        if (S_ISCHR(st.st_mode) && st.st_rdev == dev) {
            if ((st.st_mode & 07777) != mode && chmod(path, mode) != 0)
                return failure("cannot chmod %s: %s", path, strerror(errno));
            return 0;
        }
        if (unlink(path) != 0)
            return failure("cannot replace %s: %s", path, strerror(errno));
    }
    if (mknod(path, S_IFCHR | mode, dev) != 0)
        return failure("cannot create %s: %s", path, strerror(errno));
    /* mknod's mode is masked by the umask; the driver's nodes are exactly mode. */
    if (chmod(path, mode) != 0)
        return failure("cannot chmod %s: %s", path, strerror(errno));
    return 0;
}

static int nvidia_node(long minor)
{
    char rel[32];
    long major = proc_major("nvidia-frontend");
    if (major < 0)
        major = proc_major("nvidia");
    if (major < 0)
        return failure("%s: %s", "the NVIDIA kernel module", "not loaded (no nvidia-frontend in /proc/devices)");
    if (minor == CTL_MINOR)
        snprintf(rel, sizeof rel, "nvidiactl");
    else if (minor == MODESET_MINOR)
        snprintf(rel, sizeof rel, "nvidia-modeset");
    else
        snprintf(rel, sizeof rel, "nvidia%ld", minor);
    return make_node(rel, major, minor, 0666);
}

static int uvm_nodes(void)
{
    long major = proc_major("nvidia-uvm");
    if (major < 0)
        return failure("%s: %s", "nvidia-uvm", "the module is not loaded (no nvidia-uvm in /proc/devices)");
    return make_node("nvidia-uvm", major, 0, 0666) || make_node("nvidia-uvm-tools", major, 1, 0666);
}

/* -f PATH: the node of one capability file, with its DeviceFileMinor and DeviceFileMode. */
static int cap_node(const char *cap)
{
    char path[PATH_MAX + 256], line[128], rel[64];
    long minor = -1, mode = -1, value;
    if (strncmp(cap, CAPS_PREFIX, strlen(CAPS_PREFIX)) != 0 || strstr(cap, "/../") != NULL)
        return failure("%s: %s", cap, "not a capability file under " CAPS_PREFIX);
    snprintf(path, sizeof path, "%s%s", g_root, cap);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return failure("cannot read %s: %s", path, strerror(errno));
    while (fgets(line, sizeof line, file) != NULL) {
        if (sscanf(line, "DeviceFileMinor: %ld", &value) == 1)
            minor = value;
        else if (sscanf(line, "DeviceFileMode: %ld", &value) == 1)
            mode = value;
    }
    fclose(file);
    if (minor < 0 || mode < 0 || mode > 0777)
        return failure("%s: %s", path, "no DeviceFileMinor/DeviceFileMode");
    long major = proc_major("nvidia-caps");
    if (major < 0)
        return failure("%s: %s", "nvidia-caps", "not in /proc/devices (the NVIDIA module is not loaded)");
    snprintf(rel, sizeof rel, "nvidia-caps/nvidia-cap%ld", minor);
    return make_node(rel, major, minor, (mode_t)mode);
}

/* The value of an option that takes one: "-c 0", "-c0", "-c=0", "--long=0", "--long 0". */
static const char *option_value(const char *arg, size_t name_len, int argc, char **argv, int *i)
{
    const char *rest = arg + name_len;
    if (*rest == '=')
        return rest + 1;
    if (*rest != '\0')
        return arg[1] == '-' ? NULL : rest;
    return *i + 1 < argc ? argv[++*i] : NULL;
}

static int matches(const char *arg, const char *name)
{
    size_t len = strlen(name);
    return strncmp(arg, name, len) == 0 && (arg[len] == '\0' || arg[len] == '=' || (arg[1] != '-' && len == 2));
}

int main(int argc, char **argv)
{
    long minors[MAX_MINORS];
    const char *caps[MAX_MINORS];
    int n_minors = 0, n_caps = 0, uvm = 0, modeset = 0;

    if (find_root() != 0)
        return failure("%s: %s", "/proc/self/exe", "cannot find the host root");
    log_call(argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *value;
        if (strcmp(arg, "-u") == 0 || strcmp(arg, "--unified-memory") == 0)
            uvm = 1;
        else if (strcmp(arg, "-m") == 0 || strcmp(arg, "--modeset") == 0)
            modeset = 1;
        else if (strcmp(arg, "-v") == 0 || strcmp(arg, "--version") == 0) {
            printf("nvidia-modprobe:  version " DRIVER_VERSION " (simulated GPU host)\n");
            return 0;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            printf("usage: nvidia-modprobe [-u|-m] [-c N]... [-f CAPABILITY_FILE]...\n");
            return 0;
        } else if (matches(arg, "-c") || matches(arg, "--create-nvidia-device-file")) {
            value = option_value(arg, arg[1] == '-' ? strlen("--create-nvidia-device-file") : 2, argc, argv, &i);
            char *end;
            long minor = value != NULL ? strtol(value, &end, 10) : -1;
            if (value == NULL || *value == '\0' || *end != '\0' || minor < 0 || minor > CTL_MINOR)
                return failure("%s: %s", arg, "expects a device minor number 0-255");
            if (n_minors < MAX_MINORS)
                minors[n_minors++] = minor;
        } else if (matches(arg, "-f") || matches(arg, "--nvlink-capability-device-file") ||
                   matches(arg, "--nvidia-capability-device-file")) {
            size_t len = arg[1] != '-' ? 2 : strchr(arg, '=') ? (size_t)(strchr(arg, '=') - arg) : strlen(arg);
            value = option_value(arg, len, argc, argv, &i);
            if (value == NULL || *value == '\0')
                return failure("%s: %s", arg, "expects a capability file path");
            if (n_caps < MAX_MINORS)
                caps[n_caps++] = value;
        } else {
            fprintf(stderr, "nvidia-modprobe: unrecognized option: \"%s\"; see nvidia-modprobe --help\n", arg);
            return 2;
        }
    }
    if (geteuid() != 0)
        return failure("%s: %s", "nvidia-modprobe", "must be run as root");
    const char *why = broken();
    if (why != NULL) {
        fprintf(stderr, "nvidia-modprobe: %s\n", why);
        return 1;
    }
    for (int i = 0; i < n_minors; i++) {
        int failed = uvm ? uvm_nodes() : modeset ? nvidia_node(MODESET_MINOR) : nvidia_node(minors[i]);
        if (failed)
            return 1;
    }
    for (int i = 0; i < n_caps; i++)
        if (cap_node(caps[i]) != 0)
            return 1;
    return 0;
}
