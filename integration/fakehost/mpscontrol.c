/*
 * mpscontrol.c - a stand-in for NVIDIA's nvidia-cuda-mps-control on the
 * simulated GPU host that integration/fakehost builds.
 *
 * There is no GPU where gpuhook's tests run, so no MPS server can ever start;
 * what a manager (gpuhook, or NVIDIA's k8s device plugin) sees of the control
 * daemon is its command line, its pipe directory, its replies and its
 * control.log, and those follow the real program (legacy "MPS v2" interface):
 *
 *   nvidia-cuda-mps-control -d   starts the control daemon in the background;
 *                                the foreground process exits 0 only once the
 *                                daemon listens on its control socket, so the
 *                                caller may talk to it straight away.
 *   nvidia-cuda-mps-control -f   runs the daemon in the foreground (its log
 *                                lines also go to stdout).
 *   nvidia-cuda-mps-control      client: reads commands from stdin, one a line
 *                                (the last may lack its newline), sends each
 *                                to the daemon and prints its reply; exits 0.
 *                                It connects to control_privileged where it
 *                                can (the daemon's user, root), else to
 *                                control.  With neither: "Cannot find MPS
 *                                control daemon process" on stderr, exit 1.
 *
 * Environment: CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
 * CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps); CUDA_VISIBLE_DEVICES
 * is inherited by the daemon (readable in /proc/<pid>/environ) and not used.
 *
 * The pipe directory (created 0755 if missing) holds what the real daemon
 * makes there:
 *     control                      UNIX stream socket, 0666: CUDA clients (and
 *                                  any user's UI) connect here
 *     control_privileged           UNIX stream socket, 0755: the daemon's own
 *                                  user's (or root's) UI connects here
 *     control_lock                 regular file, 0666, flock()ed while it runs
 *     log                          FIFO, 0777 (made, never written)
 *     nvidia-cuda-mps-control.pid  the daemon's pid and a newline, 0666
 * A second daemon on the same pipe directory finds control_lock locked and
 * refuses: "An instance of this daemon is already running" on stderr, exit
 * status 1.  A daemon killed with SIGKILL leaves its entries behind, but the
 * kernel drops its lock, so the next -d replaces the stale sockets and starts.
 * On quit (or SIGTERM/SIGINT) the daemon removes every entry above and exits 0.
 *
 * $CUDA_MPS_LOG_DIRECTORY/control.log (directory created 0755 if missing,
 * file 0644, appended to) has the real line format
 *     [2026-12-01 12:00:00.123 Control  4242] Starting control daemon using socket /tmp/nvidia-mps/control
 *     [2026-12-01 12:00:00.123 Control  4242] To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps
 * and, for each client connection (one per client process):
 *     ... Accepting connection...
 *     ... NEW UI
 *     ... Cmd:set_default_active_thread_percentage 50
 *     ... 50.0                     (each reply line, when there is a reply)
 *     ... UI closed
 * Each line is one write(2) to an O_APPEND file, so a reader never sees half
 * a line.
 *
 * Commands (the real names; state lasts until the daemon quits):
 *   set_default_active_thread_percentage P   0 < P <= 100; reply P as "%.1f"
 *   get_default_active_thread_percentage     reply the value, "100.0" by default
 *   set_default_device_pinned_mem_limit DEV LIMIT
 *       DEV: a device ordinal or a GPU-/MIG- UUID; LIMIT: an integer and M or
 *       G (MiB, GiB), e.g. 40960M, 40G; no reply
 *   get_default_device_pinned_mem_limit DEV  reply the stored limit in G when
 *       a whole number of GiB, else in M ("40960M" reads back as "40G"); no
 *       reply when none was set for DEV
 *   get_server_list                          no server ever runs: no reply
 *   quit                                     no reply; the daemon exits
 * A command not understood (an unknown name, a percentage out of range, a
 * malformed limit) is logged as "Cmd:..." like any other, changes nothing and
 * gets no reply; the daemon keeps running.
 *
 * Privileged commands (those that change the daemon: quit, the set_default_*
 * commands, start_server) are run only for a connection to
 * control_privileged; on control they are logged, then refused with the reply
 * "Permission denied", and change nothing: a client that can reach control
 * alone (a container given only that socket) can ask, never steer.
 *
 * Wire format between client and daemon (the real one is private; this one
 * is the stand-in's own): the client sends each command as a line; the
 * daemon answers with the reply text followed by one NUL byte, so an empty
 * reply is still an answer.  The daemon serves any number of clients at once
 * from one poll loop, each command whole, so concurrent clients each get
 * their own reply.  At the end of its input the client half-closes the
 * connection and waits for the daemon to close it, so by the time a client
 * exits, the daemon has logged "UI closed" for it.
 *
 * Paths longer than sun_path allows are reached through /proc/self/fd/<dir>.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_PIPE_DIR "/tmp/nvidia-mps"
#define DEFAULT_LOG_DIR "/var/log/nvidia-mps"
#define MAX_CLIENTS 128
#define MAX_LIMITS 64
#define LINE_MAX_LEN 4096
#define MSG_ALREADY "An instance of this daemon is already running\n"
#define MSG_NO_DAEMON "Cannot find MPS control daemon process\n"

static const char *const PIPE_ENTRIES[] = {
    "control", "control_privileged", "log", "nvidia-cuda-mps-control.pid", "control_lock",
};

struct client {
    int fd;
    int privileged; /* accepted on control_privileged */
    size_t used;
    char buf[LINE_MAX_LEN];
};

struct limit {
    char dev[128];
    unsigned long long bytes;
};

static struct {
    const char *pipe_dir;
    const char *log_dir;
    int dir_fd;     /* the pipe directory */
    int log_fd;     /* control.log */
    int echo_fd;    /* -f: log lines also go here (stdout), else -1 */
    int listen_fd[2];
    double percentage;
    struct limit limits[MAX_LIMITS];
    int nlimits;
    struct client clients[MAX_CLIENTS];
    int quitting;
} D = {.dir_fd = -1, .log_fd = -1, .echo_fd = -1, .listen_fd = {-1, -1}, .percentage = 100.0};

static const char *env_or(const char *name, const char *fallback)
{
    const char *value = getenv(name);
    return value && *value ? value : fallback;
}

static void write_all(int fd, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        data += n;
        len -= (size_t)n;
    }
}

/* One control.log line, "[date time.ms Control  pid] message". */
static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...)
{
    char line[LINE_MAX_LEN + 128];
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    localtime_r(&now.tv_sec, &tm);
    int n = (int)strftime(line, sizeof line, "[%Y-%m-%d %H:%M:%S", &tm);
    n += snprintf(line + n, sizeof line - (size_t)n, ".%03ld Control %5d] ", now.tv_nsec / 1000000,
                  (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        m = 0;
    n += m;
    if ((size_t)n > sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (D.log_fd >= 0)
        write_all(D.log_fd, line, (size_t)n);
    if (D.echo_fd >= 0)
        write_all(D.echo_fd, line, (size_t)n);
}

/* A sockaddr for dir/name, through /proc/self/fd when the path is too long. */
static int socket_address(struct sockaddr_un *addr, const char *dir, int dir_fd, const char *name)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    int n = snprintf(addr->sun_path, sizeof addr->sun_path, "%s/%s", dir, name);
    if (n > 0 && (size_t)n < sizeof addr->sun_path)
        return 0;
    n = snprintf(addr->sun_path, sizeof addr->sun_path, "/proc/self/fd/%d/%s", dir_fd, name);
    if (n > 0 && (size_t)n < sizeof addr->sun_path)
        return 0;
    errno = ENAMETOOLONG;
    return -1;
}

static int mkdir_p(const char *path, mode_t mode)
{
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, mode) < 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(buf, mode) < 0 && errno != EEXIST)
        return -1;
    return 0;
}

/* ---- client mode --------------------------------------------------------- */

/* A connection to dir/name; -1 when there is none to be had. */
static int connect_to(const char *dir, int dir_fd, const char *name)
{
    struct sockaddr_un addr;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (socket_address(&addr, dir, dir_fd, name) < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int run_client(void)
{
    const char *dir = env_or("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR);
    int dir_fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    int fd = dir_fd < 0 ? -1 : connect_to(dir, dir_fd, "control_privileged");
    if (fd < 0 && dir_fd >= 0)
        fd = connect_to(dir, dir_fd, "control");
    if (fd < 0) {
        fputs(MSG_NO_DAEMON, stderr);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, stdin)) >= 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = '\0';
        if (len == 0)
            continue;
        line[len] = '\n';
        if (send(fd, line, (size_t)len + 1, MSG_NOSIGNAL) < 0)
            break;
        /* The reply runs to a NUL; EOF means the daemon went (quit). */
        char reply[LINE_MAX_LEN];
        int done = 0;
        while (!done) {
            ssize_t n = recv(fd, reply, sizeof reply, 0);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                fflush(stdout);
                free(line);
                return 0;
            }
            char *end = memchr(reply, '\0', (size_t)n);
            if (end) {
                n = end - reply;
                done = 1;
            }
            fwrite(reply, 1, (size_t)n, stdout);
        }
        fflush(stdout);
    }
    free(line);
    /* Done sending; wait for the daemon to hang up, so that when this process
     * exits the daemon is done with the connection (and has logged it). */
    shutdown(fd, SHUT_WR);
    char rest[256];
    for (;;) {
        ssize_t n = recv(fd, rest, sizeof rest, 0);
        if (n == 0 || (n < 0 && errno != EINTR))
            break;
    }
    close(fd);
    return 0;
}

/* ---- daemon: the lock ---------------------------------------------------- */

/* Locks control_lock (made if missing), making sure the locked inode is the
 * one the path names: a quitting daemon unlinks it while it holds the lock. */
static int lock_pipe_dir(int dir_fd)
{
    for (;;) {
        int fd = openat(dir_fd, "control_lock", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0)
            return -1;
        fchmod(fd, 0666);
        if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
            int saved = errno;
            close(fd);
            errno = saved;
            return -2;
        }
        struct stat held, named;
        if (fstat(fd, &held) == 0 && fstatat(dir_fd, "control_lock", &named, 0) == 0 &&
            held.st_dev == named.st_dev && held.st_ino == named.st_ino)
            return fd;
        close(fd);
    }
}

/* ---- daemon: commands ---------------------------------------------------- */

static int valid_device(const char *dev)
{
    if (!*dev || strlen(dev) >= sizeof D.limits[0].dev)
        return 0;
    if (strncmp(dev, "GPU-", 4) == 0 || strncmp(dev, "MIG-", 4) == 0)
        return dev[4] != '\0';
    for (const char *p = dev; *p; p++)
        if (*p < '0' || *p > '9')
            return 0;
    return 1;
}

/* "40960M" or "40G" in bytes; 0 when malformed. */
static unsigned long long parse_limit(const char *text)
{
    char *end;
    if (*text < '0' || *text > '9')
        return 0;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || value == 0 || end[0] == '\0' || end[1] != '\0')
        return 0;
    switch (end[0]) {
    case 'M': case 'm':
        return value > (~0ULL >> 20) ? 0 : value << 20;
    case 'G': case 'g':
        return value > (~0ULL >> 30) ? 0 : value << 30;
    default:
        return 0;
    }
}

static struct limit *find_limit(const char *dev)
{
    for (int i = 0; i < D.nlimits; i++)
        if (strcmp(D.limits[i].dev, dev) == 0)
            return &D.limits[i];
    return NULL;
}

/* The commands that change the daemon: control_privileged's alone. */
static int is_privileged(const char *name)
{
    return strcmp(name, "quit") == 0 || strcmp(name, "start_server") == 0 ||
           strncmp(name, "set_default_", strlen("set_default_")) == 0;
}

/* Runs one command; writes the reply (possibly empty) into reply. */
static void run_command(char *line, char *reply, size_t size, int privileged)
{
    reply[0] = '\0';
    logf_("Cmd:%s", line);
    char *save = NULL;
    char *name = strtok_r(line, " \t", &save);
    char *arg1 = strtok_r(NULL, " \t", &save);
    char *arg2 = strtok_r(NULL, " \t", &save);
    char *extra = strtok_r(NULL, " \t", &save);
    if (!name)
        return;
    if (!privileged && is_privileged(name)) {
        snprintf(reply, size, "Permission denied\n");
    } else if (strcmp(name, "quit") == 0 && !arg1) {
        D.quitting = 1;
    } else if (strcmp(name, "get_server_list") == 0 && !arg1) {
        /* No server ever starts without a GPU. */
    } else if (strcmp(name, "get_default_active_thread_percentage") == 0 && !arg1) {
        snprintf(reply, size, "%.1f\n", D.percentage);
    } else if (strcmp(name, "set_default_active_thread_percentage") == 0 && arg1 && !arg2) {
        char *end;
        errno = 0;
        double value = strtod(arg1, &end);
        if (!errno && end != arg1 && *end == '\0' && value > 0.0 && value <= 100.0) {
            D.percentage = value;
            snprintf(reply, size, "%.1f\n", D.percentage);
        }
    } else if (strcmp(name, "set_default_device_pinned_mem_limit") == 0 && arg2 && !extra) {
        unsigned long long bytes = parse_limit(arg2);
        if (bytes && valid_device(arg1)) {
            struct limit *limit = find_limit(arg1);
            if (!limit && D.nlimits < MAX_LIMITS) {
                limit = &D.limits[D.nlimits++];
                snprintf(limit->dev, sizeof limit->dev, "%s", arg1);
            }
            if (limit)
                limit->bytes = bytes;
        }
    } else if (strcmp(name, "get_default_device_pinned_mem_limit") == 0 && arg1 && !arg2) {
        struct limit *limit = find_limit(arg1);
        if (limit && limit->bytes % (1ULL << 30) == 0)
            snprintf(reply, size, "%lluG\n", limit->bytes >> 30);
        else if (limit)
            snprintf(reply, size, "%lluM\n", limit->bytes >> 20);
    }
    /* Each reply line is logged, as the real daemon does. */
    for (char *p = reply; *p;) {
        char *nl = strchr(p, '\n');
        int n = nl ? (int)(nl - p) : (int)strlen(p);
        logf_("%.*s", n, p);
        p += n + (nl != NULL);
    }
}

/* Logged before the close: a client waits for the close before it exits. */
static void close_client(struct client *c)
{
    logf_("UI closed");
    close(c->fd);
    c->fd = -1;
    c->used = 0;
}

static void answer(struct client *c, char *line)
{
    char reply[LINE_MAX_LEN];
    size_t len = strlen(line);
    while (len > 0 && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t'))
        line[--len] = '\0';
    while (*line == ' ' || *line == '\t')
        line++;
    if (!*line)
        return;
    run_command(line, reply, sizeof reply, c->privileged);
    /* Reply, then NUL: an empty reply is still an answer. */
    if (send(c->fd, reply, strlen(reply) + 1, MSG_NOSIGNAL) < 0)
        return;
}

/* Reads what a client sent; runs each whole line (and, at EOF, the rest). */
static void serve(struct client *c)
{
    ssize_t n = recv(c->fd, c->buf + c->used, sizeof c->buf - 1 - c->used, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        if (c->used > 0) {
            c->buf[c->used] = '\0';
            c->used = 0;
            answer(c, c->buf);
        }
        close_client(c);
        return;
    }
    c->used += (size_t)n;
    char *start = c->buf;
    char *nl;
    while (!D.quitting && (nl = memchr(start, '\n', c->used - (size_t)(start - c->buf)))) {
        *nl = '\0';
        answer(c, start);
        start = nl + 1;
    }
    size_t rest = c->used - (size_t)(start - c->buf);
    memmove(c->buf, start, rest);
    c->used = rest;
    if (c->used == sizeof c->buf - 1) /* a line too long to be a command */
        close_client(c);
}

static void accept_client(int listen_fd, int privileged)
{
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        return;
    logf_("Accepting connection...");
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (D.clients[i].fd < 0) {
            D.clients[i].fd = fd;
            D.clients[i].used = 0;
            D.clients[i].privileged = privileged;
            logf_("NEW UI");
            return;
        }
    }
    close(fd);
}

static void remove_entries(void)
{
    for (size_t i = 0; i < sizeof PIPE_ENTRIES / sizeof PIPE_ENTRIES[0]; i++)
        unlinkat(D.dir_fd, PIPE_ENTRIES[i], 0);
}

/* SIGTERM, SIGINT (quit) and SIGHUP (ignored) arrive through a signalfd. Done
 * before the daemon is ready, so a signal sent straight after -d returns is
 * not lost to the default action (which would leave the entries behind). */
static int block_signals(void)
{
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    return signalfd(-1, &mask, SFD_CLOEXEC);
}

static int event_loop(int sig_fd)
{
    for (int i = 0; i < MAX_CLIENTS; i++)
        D.clients[i].fd = -1;
    while (!D.quitting) {
        struct pollfd fds[3 + MAX_CLIENTS];
        int slot[3 + MAX_CLIENTS];
        int n = 0;
        fds[n++] = (struct pollfd){.fd = sig_fd, .events = POLLIN};
        fds[n++] = (struct pollfd){.fd = D.listen_fd[0], .events = POLLIN};
        fds[n++] = (struct pollfd){.fd = D.listen_fd[1], .events = POLLIN};
        for (int i = 0; i < MAX_CLIENTS; i++) {
            if (D.clients[i].fd >= 0) {
                slot[n] = i;
                fds[n++] = (struct pollfd){.fd = D.clients[i].fd, .events = POLLIN};
            }
        }
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (fds[0].revents) {
            struct signalfd_siginfo info;
            if (read(sig_fd, &info, sizeof info) == (ssize_t)sizeof info && info.ssi_signo != SIGHUP)
                break;
        }
        for (int k = 1; k < 3; k++)
            if (fds[k].revents & POLLIN)
                accept_client(fds[k].fd, k == 2);
        for (int k = 3; k < n && !D.quitting; k++)
            if (fds[k].revents)
                serve(&D.clients[slot[k]]);
    }
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (D.clients[i].fd >= 0)
            close_client(&D.clients[i]);
    remove_entries();
    return 0;
}

/* ---- daemon: start-up ---------------------------------------------------- */

static int listen_on(const char *name, mode_t mode)
{
    struct sockaddr_un addr;
    unlinkat(D.dir_fd, name, 0); /* a killed daemon's stale socket */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || socket_address(&addr, D.pipe_dir, D.dir_fd, name) < 0 ||
        bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 64) < 0 ||
        fchmodat(D.dir_fd, name, mode, 0) < 0)
        return -1;
    return fd;
}

/* Everything the daemon makes before it is ready; NULL or what failed. */
static const char *set_up(void)
{
    static char why[512];
    char path[4096];
    if (mkdir_p(D.log_dir, 0755) < 0) {
        snprintf(why, sizeof why, "cannot create log directory %.400s: %s\n", D.log_dir, strerror(errno));
        return why;
    }
    snprintf(path, sizeof path, "%s/control.log", D.log_dir);
    D.log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (D.log_fd < 0) {
        snprintf(why, sizeof why, "cannot open %.400s: %s\n", path, strerror(errno));
        return why;
    }
    D.listen_fd[0] = listen_on("control", 0666);
    D.listen_fd[1] = D.listen_fd[0] < 0 ? -1 : listen_on("control_privileged", 0755);
    if (D.listen_fd[1] < 0) {
        snprintf(why, sizeof why, "cannot listen in %.400s: %s\n", D.pipe_dir, strerror(errno));
        return why;
    }
    unlinkat(D.dir_fd, "log", 0);
    if (mkfifoat(D.dir_fd, "log", 0777) == 0)
        fchmodat(D.dir_fd, "log", 0777, 0);
    int pid_fd = openat(D.dir_fd, "nvidia-cuda-mps-control.pid", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (pid_fd >= 0) {
        char pid[32];
        int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
        write_all(pid_fd, pid, (size_t)n);
        fchmod(pid_fd, 0666);
        close(pid_fd);
    }
    logf_("Starting control daemon using socket %s/control", D.pipe_dir);
    logf_("To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=%s", D.pipe_dir);
    return NULL;
}

static int open_pipe_dir(void)
{
    if (mkdir_p(D.pipe_dir, 0755) < 0 ||
        (D.dir_fd = open(D.pipe_dir, O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0) {
        fprintf(stderr, "cannot use pipe directory %s: %s\n", D.pipe_dir, strerror(errno));
        return -1;
    }
    int lock = lock_pipe_dir(D.dir_fd);
    if (lock == -2) {
        fputs(MSG_ALREADY, stderr);
        return -1;
    }
    if (lock < 0) {
        fprintf(stderr, "cannot lock %s/control_lock: %s\n", D.pipe_dir, strerror(errno));
        return -1;
    }
    return lock; /* held (open) for the daemon's life */
}

static int run_foreground(void)
{
    if (open_pipe_dir() < 0)
        return 1;
    D.echo_fd = STDOUT_FILENO;
    int sig_fd = block_signals();
    const char *why = set_up();
    if (why) {
        fputs(why, stderr);
        remove_entries();
        return 1;
    }
    return event_loop(sig_fd);
}

static int run_daemon(void)
{
    if (open_pipe_dir() < 0)
        return 1;
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) < 0)
        return 1;
    fflush(NULL);
    pid_t child = fork();
    if (child < 0)
        return 1;
    if (child > 0) {
        /* The foreground process: wait for "ready" (or why not). */
        close(ready[1]);
        char status[600];
        ssize_t got = 0, n;
        while ((n = read(ready[0], status + got, sizeof status - 1 - (size_t)got)) > 0 ||
               (n < 0 && errno == EINTR))
            if (n > 0)
                got += n;
        waitpid(child, NULL, 0);
        if (got > 0 && status[0] == 'R')
            return 0;
        status[got] = '\0';
        fputs(got > 1 ? status + 1 : MSG_NO_DAEMON, stderr);
        return 1;
    }
    close(ready[0]);
    setsid();
    pid_t daemon = fork();
    if (daemon != 0)
        _exit(daemon < 0);
    /* The daemon: no terminal, no stdio. */
    if (chdir("/") < 0) {
        /* not fatal */
    }
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, STDIN_FILENO);
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
        if (null > STDERR_FILENO)
            close(null);
    }
    signal(SIGPIPE, SIG_IGN);
    int sig_fd = block_signals();
    const char *why = set_up();
    if (why) {
        char msg[600];
        int n = snprintf(msg, sizeof msg, "E%s", why);
        write_all(ready[1], msg, (size_t)n);
        remove_entries();
        _exit(1);
    }
    write_all(ready[1], "R", 1);
    close(ready[1]);
    _exit(event_loop(sig_fd));
}

int main(int argc, char **argv)
{
    D.pipe_dir = env_or("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR);
    D.log_dir = env_or("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG_DIR);
    if (argc == 1)
        return run_client();
    if (argc == 2 && (strcmp(argv[1], "-d") == 0 || strcmp(argv[1], "--daemon") == 0))
        return run_daemon();
    if (argc == 2 && (strcmp(argv[1], "-f") == 0 || strcmp(argv[1], "--foreground") == 0))
        return run_foreground();
    fprintf(stderr, "Usage: %s [-d | -f]\n", argv[0]);
    return 1;
}
