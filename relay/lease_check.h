/*
 * A poststop whose container certainly holds no lease, answered by the relay itself: the Python
 * hook's own fast path (hookcall.lease_may_exist), ported, so that most containers' stop costs no
 * round trip to gpuhookd (~0.9 ms of its Python per call).
 *
 * Every step here is a subset of the Python one: whatever it is not certain of (an argv, state, config
 * or ledger of any other shape, a file it cannot read) makes no_lease() return 0, and the call goes
 * to gpuhookd (or the Python hook) as before. A wrong 1 would only delay a release (the holder watch
 * and reclaim release a lease whose container is gone), never give anything away; it is still avoided:
 *   - the argv is gpuhook's own `[--debug] [--config F] [--daemon-socket S] poststop` (parse_hook_argv);
 *   - the state is one JSON object strictjson.loads_object accepts (ASCII only, no escaped key, no
 *     duplicate key, at most MAX_DEPTH deep) whose top-level "id" is a plain string ([A-Za-z0-9_.-]+);
 *   - the config is found and read as lease_may_exist finds and reads it (--config, GPUHOOK_CONFIG,
 *     /etc/gpuhook/config.yaml, NVIDIA's config.toml), and its state_dir taken only from the one shape
 *     _flat_state_dir accepts;
 *   - the ledger, <state_dir>/leases.json, is written whole by rename (provision/ledger_store.py), so
 *     reading it without the lock shows every lease taken before this call; no
 *     `"container_id": "<id>"` in it means no lease.
 * tests/unit/test_relay.py runs both over the same inputs.
 */
#ifndef GPUHOOK_LEASE_CHECK_H
#define GPUHOOK_LEASE_CHECK_H

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef DEFAULT_CONFIG  /* these three: build.sh's RELAY_DEFINES may move them (tests) */
#define DEFAULT_CONFIG "/etc/gpuhook/config.yaml"            /* hookcall._DEFAULT_CONFIG */
#define NVIDIA_CONFIG "/etc/nvidia-container-runtime/config.toml"  /* hookcall._NVIDIA_CONFIG */
#define DEFAULT_STATE_DIR "/run/gpuhook"                     /* hookcall.DEFAULT_STATE_DIR */
#endif
#define LEDGER_NAME "leases.json"                            /* hookcall.LEDGER_NAME */
#define CONFIG_LIMIT (1 << 20)                               /* hookcall._read_small's limit */
#define LEDGER_LIMIT (64 << 20)                              /* far above any ledger; past it, gpuhookd reads it */
#define MAX_DEPTH 64                                         /* Python's own limit is its recursion limit */
#define MAX_KEYS 4096                                        /* keys of the objects open at once */
#define MAX_NUMBER 64                                        /* int() refuses over 4300 digits */

/* --- the state: a conservative strict-JSON check --------------------------------------------- */

struct json_scan {
    const char *p, *end;
    const char *key_at[MAX_KEYS];
    size_t key_len[MAX_KEYS], keys;
    const char *id;     /* the top-level "id" string's bytes, when it is plain */
    size_t id_len;
    int ids;            /* how many top-level "id" keys (a second is a duplicate, refused anyway) */
};

static int json_value(struct json_scan *s, int depth);

static void json_blank(struct json_scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static int is_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A string at s->p ('"'): 0 and its raw bytes (*escaped: it holds a backslash), or -1. */
static int json_string(struct json_scan *s, const char **at, size_t *len, int *escaped)
{
    const char *p = ++s->p;
    *escaped = 0;
    for (;;) {
        if (p == s->end)
            return -1;
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            break;
        if (c < 0x20 || c >= 0x80)  /* a control character (strict), or not ASCII: not worth validating UTF-8 */
            return -1;
        if (c == '\\') {
            *escaped = 1;
            if (++p == s->end)
                return -1;
            if (*p == 'u') {
                if (s->end - p < 5 || !is_hex(p[1]) || !is_hex(p[2]) || !is_hex(p[3]) || !is_hex(p[4]))
                    return -1;
                p += 4;
            } else if (!strchr("\"\\/bfnrt", *p) || !*p) {
                return -1;
            }
        }
        p++;
    }
    *at = s->p;
    *len = (size_t)(p - s->p);
    s->p = p + 1;
    return 0;
}

static const char *json_digits(const char *p, const char *end)
{
    while (p < end && *p >= '0' && *p <= '9')
        p++;
    return p;
}

/* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, not too long for int() */
static int json_number(struct json_scan *s)
{
    const char *p = s->p, *d;
    if (p < s->end && *p == '-')
        p++;
    if (p < s->end && *p == '0')
        p++;
    else if ((d = json_digits(p, s->end)) > p)
        p = d;
    else
        return -1;
    if (p < s->end && *p == '.') {
        if ((d = json_digits(p + 1, s->end)) == p + 1)
            return -1;
        p = d;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < s->end && (*p == '+' || *p == '-'))
            p++;
        if ((d = json_digits(p, s->end)) == p)
            return -1;
        p = d;
    }
    if (p - s->p > MAX_NUMBER)
        return -1;
    s->p = p;
    return 0;
}

static int json_word(struct json_scan *s, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
        return -1;
    s->p += n;
    return 0;
}

/* `{ "key": value, ... }` with no key twice; at depth 1 it notes a plain "id". */
static int json_object(struct json_scan *s, int depth)
{
    size_t first = s->keys;
    s->p++;
    json_blank(s);
    if (s->p < s->end && *s->p == '}') {
        s->p++;
        return 0;
    }
    for (;;) {
        const char *key;
        size_t len;
        int escaped;
        if (s->p == s->end || *s->p != '"' || json_string(s, &key, &len, &escaped) || escaped || s->keys == MAX_KEYS)
            return -1;  /* an escaped key could equal another once decoded: not compared here */
        for (size_t k = first; k < s->keys; k++)
            if (s->key_len[k] == len && memcmp(s->key_at[k], key, len) == 0)
                return -1;
        s->key_at[s->keys] = key;
        s->key_len[s->keys++] = len;
        json_blank(s);
        if (s->p == s->end || *s->p++ != ':')
            return -1;
        json_blank(s);
        if (depth == 1 && len == 2 && memcmp(key, "id", 2) == 0) {
            const char *id;
            size_t id_len;
            s->ids++;
            if (s->p == s->end || *s->p != '"' || json_string(s, &id, &id_len, &escaped))
                return -1;  /* not a string: the full path says what it is */
            if (!escaped)
                s->id = id, s->id_len = id_len;
        } else if (json_value(s, depth)) {
            return -1;
        }
        json_blank(s);
        if (s->p == s->end)
            return -1;
        if (*s->p == '}') {
            s->p++;
            s->keys = first;
            return 0;
        }
        if (*s->p++ != ',')
            return -1;
        json_blank(s);
    }
}

static int json_array(struct json_scan *s, int depth)
{
    s->p++;
    json_blank(s);
    if (s->p < s->end && *s->p == ']') {
        s->p++;
        return 0;
    }
    for (;;) {
        if (json_value(s, depth))
            return -1;
        json_blank(s);
        if (s->p == s->end)
            return -1;
        if (*s->p == ']') {
            s->p++;
            return 0;
        }
        if (*s->p++ != ',')
            return -1;
        json_blank(s);
    }
}

/* A value inside a container at *depth* (1: the top-level object's). */
static int json_value(struct json_scan *s, int depth)
{
    const char *at;
    size_t len;
    int escaped;
    if (s->p == s->end)
        return -1;
    switch (*s->p) {
    case '{':
        return depth >= MAX_DEPTH ? -1 : json_object(s, depth + 1);
    case '[':
        return depth >= MAX_DEPTH ? -1 : json_array(s, depth + 1);
    case '"':
        return json_string(s, &at, &len, &escaped);
    case 't':
        return json_word(s, "true");
    case 'f':
        return json_word(s, "false");
    case 'n':
        return json_word(s, "null");
    default:
        return json_number(s);
    }
}

static int plain_id(const char *id, size_t len)
{
    if (!len)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-", id[i]) || !id[i])
            return 0;
    return 1;
}

/* 0 and the state's plain "id" (hookcall._plain), when the state is certainly one valid JSON object. */
static int state_id(const char *data, size_t len, const char **id, size_t *id_len)
{
    static struct json_scan s;  /* 48 KiB of key slots: not on the stack */
    memset(&s, 0, sizeof s);
    s.p = data;
    s.end = data + len;
    json_blank(&s);
    if (s.p == s.end || *s.p != '{' || json_object(&s, 1))
        return -1;
    json_blank(&s);
    if (s.p != s.end || s.ids != 1 || !s.id || !plain_id(s.id, s.id_len))
        return -1;
    *id = s.id;
    *id_len = s.id_len;
    return 0;
}

/* --- the config and the ledger ------------------------------------------------------------------ */

enum read_result { READ_OK, READ_MISSING, READ_UNUSABLE };

/* All of *path* into a malloc'ed buffer (*data, *len) if it has at most *limit* bytes. */
static enum read_result read_whole(const char *path, size_t limit, char **data, size_t *len)
{
    /* Not blocking: a FIFO there must not hang a container's stop (Python would wait; here it is unusable). */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    *data = NULL;
    *len = 0;
    if (fd < 0)
        return errno == ENOENT ? READ_MISSING : READ_UNUSABLE;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (size_t)st.st_size > limit ||
        !(*data = malloc((size_t)st.st_size + 1))) {
        (void)close(fd);
        return READ_UNUSABLE;
    }
    size_t size = (size_t)st.st_size + 1;  /* one byte more: a file that grew is seen to */
    for (;;) {
        ssize_t n = read(fd, *data + *len, size - *len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || *len + (size_t)n == size) {  /* an error, or more than its size said: read it next time */
            (void)close(fd);
            free(*data);
            *data = NULL;
            return READ_UNUSABLE;
        }
        if (n == 0)
            break;
        *len += (size_t)n;
    }
    (void)close(fd);
    return READ_OK;
}

static int has_bytes(const char *text, size_t len, const char *what)
{
    return memmem(text, len, what, strlen(what)) != NULL;
}

/* hookcall._starts_plainly for the line at p (end: the text's end). */
static int starts_plainly(const char *p, const char *end, int comment_ok)
{
    if (p == end || *p == '\n' || *p == '\r' || *p == ' ' || *p == '\t' || *p == '#')
        return comment_ok;
    return *p >= 'a' && *p <= 'z';
}

/* The line after the one at p (bytes.splitlines' breaks: \n, \r\n, \r); end if none. */
static const char *next_line(const char *p, const char *end)
{
    while (p < end && *p != '\n' && *p != '\r')
        p++;
    if (p < end && *p == '\r' && p + 1 < end && p[1] == '\n')
        p++;
    return p < end ? p + 1 : end;
}

/*
 * hookcall._flat_state_dir: 0 and the state_dir (*dir, "" for null) when the config certainly sets it so
 * or leaves it at the default; -1 when its shape leaves any doubt. *dir points into text or is a constant.
 */
static int flat_state_dir(char *text, size_t len, const char **dir)
{
    char *end = text + len, *at = NULL;
    if (memchr(text, '\\', len))
        return -1;
    for (const char *line = text; line < end; line = next_line(line, end))
        if (!starts_plainly(line, end, 1))
            return -1;
    for (char *p = text; (p = memmem(p, (size_t)(end - p), "state_dir", 9)) != NULL; p += 9) {
        if (at)
            return -1;  /* twice */
        at = p;
    }
    if (!at) {
        *dir = DEFAULT_STATE_DIR;
        return 0;
    }
    /* It starts a line, as the key of a top-level `state_dir:` line, and the next line starts another key. */
    if ((at != text && at[-1] != '\n' && at[-1] != '\r') || (size_t)(end - at) < 10 || at[9] != ':' ||
        (at + 10 < end && at[10] != ' ' && at[10] != '\n' && at[10] != '\r'))
        return -1;  /* `state_dir:/x` is one scalar, not a key and its value */
    char *value = at + 10, *stop = value, *after = (char *)next_line(at, end);
    if (after < end && !starts_plainly(after, end, 0))
        return -1;
    while (stop < end && *stop != '\n' && *stop != '\r' && !(*stop == '#' && stop > value && stop[-1] == ' '))
        stop++;
    if (stop < end && *stop == '#')
        stop--;  /* partition(b" #"): the space goes with the comment */
    while (value < stop && *value == ' ')
        value++;
    while (stop > value && stop[-1] == ' ')
        stop--;
    /* hookcall._plain_path */
    if (stop - value > 1 && (*value == '"' || *value == '\'') && stop[-1] == *value)
        value++, stop--;
    size_t n = (size_t)(stop - value);
    if (n == 0 || (n == 1 && *value == '~') ||
        (n == 4 && (!memcmp(value, "null", 4) || !memcmp(value, "Null", 4) || !memcmp(value, "NULL", 4)))) {
        *dir = "";
        return 0;
    }
    if (*value != '/')
        return -1;
    for (const char *c = value; c < stop; c++)
        if ((unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f || strchr("\"'#:{}[],&*!|>%@`", *c))
            return -1;  /* a tag, an alias, a flow, a control or non-ASCII byte: the full load reads it */
    *stop = '\0';
    *dir = value;
    return 0;
}

/*
 * 1: the container of this poststop (argv: gpuhook's own; state: the OCI state) certainly holds no
 * lease (hookcall.lease_may_exist is False); 0: gpuhookd or the Python hook decides.
 */
static int no_lease(int argc, char **argv, const char *command, const char *state_data, size_t state_size,
                    size_t state_limit, const char *config_env)
{
    const char *config = NULL, *id, *dir;
    size_t id_len;
    int i = 1;
    char *text = NULL, *ledger = NULL;
    size_t text_len, ledger_len;
    enum read_result got;
    if (strcmp(command, "gpuhook") != 0)
        return 0;  /* NVIDIA's names: their flags are translated by the full path */
    while (argc - i > 1) {  /* hookcall.parse_hook_argv */
        const char *word = argv[i++];
        if (strcmp(word, "--debug") == 0)
            continue;
        if (strcmp(word, "--config") == 0 && argv[i][0] != '-' && argc - i > 1)
            config = argv[i++];
        else if (strncmp(word, "--config=", 9) == 0)
            config = word + 9;
        else if (strcmp(word, "--daemon-socket") == 0 && argc - i > 1)
            i++;
        else
            return 0;
    }
    if (argc - i != 1 || strcmp(argv[i], "poststop") != 0 || state_size > state_limit ||
        state_id(state_data, state_size, &id, &id_len))
        return 0;
    if (!config || !*config)
        config = config_env && *config_env ? config_env : DEFAULT_CONFIG;
    int is_default = strcmp(config, DEFAULT_CONFIG) == 0;
    got = read_whole(config, CONFIG_LIMIT, &text, &text_len);
    if (got == READ_UNUSABLE || (got == READ_MISSING && !is_default))
        return 0;  /* a named config must exist: the full load says so */
    if (is_default && text_len == 0) {  /* gpuhook has none of its own: NVIDIA's may be the config */
        free(text);
        got = read_whole(NVIDIA_CONFIG, CONFIG_LIMIT, &text, &text_len);
        if (got == READ_UNUSABLE)
            return 0;
        /* Only its [gpuhook] table can move state_dir, spelled otherwise only with \u escapes. */
        if (text && !has_bytes(text, text_len, "state_dir") && !has_bytes(text, text_len, "\\u") &&
            !has_bytes(text, text_len, "\\U"))
            text_len = 0;
    }
    int certain = flat_state_dir(text ? text : (char *)"", text ? text_len : 0, &dir) == 0;
    if (certain && *dir) {
        char path[4096];
        int n = snprintf(path, sizeof path, "%s/%s", dir, LEDGER_NAME);
        char needle[sizeof "\"container_id\": \"\"" + 256];
        certain = n > 0 && (size_t)n < sizeof path && id_len <= 256;
        if (certain) {
            got = read_whole(path, LEDGER_LIMIT, &ledger, &ledger_len);
            (void)snprintf(needle, sizeof needle, "\"container_id\": \"%.*s\"", (int)id_len, id);
            certain = got == READ_MISSING || (got == READ_OK && !(ledger && has_bytes(ledger, ledger_len, needle)));
        }
    }
    free(text);
    free(ledger);
    return certain;
}

#endif
