/* What ld.so finds for each name in an ld.so.cache: glibc 2.36's search_cache (elf/dl-cache.c), a binary
 * search by _dl_cache_libcmp, as x86-64 runs it: char is signed and int arithmetic wraps (built with
 * -fsigned-char -fwrapv, which say so). An oracle written apart from gpuhook's Python.
 *
 * usage: cachesearch CACHE < names   (names NUL-separated)
 * prints, for each name, "flags:hwcap:path\0" per entry of a flag ld.so takes (libc6 x86-64, or plain ELF),
 * in the order ld.so considers them, then "\0".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct header {
  char magic[20];
  uint32_t nlibs, len_strings;
  uint8_t flags, pad[3];
  uint32_t extension_offset, unused[3];
};

struct entry {
  int32_t flags;
  uint32_t key, value, osversion;
  uint64_t hwcap;
};

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* _dl_cache_libcmp: runs of digits compare as the numbers they make in an int, other bytes as chars */
static int libcmp(const char *left, const char *right) {
  while (*left != '\0') {
    if (is_digit(*left)) {
      if (!is_digit(*right))
        return 1;
      int a = *left++ - '0', b = *right++ - '0';
      while (is_digit(*left))
        a = a * 10 + *left++ - '0';
      while (is_digit(*right))
        b = b * 10 + *right++ - '0';
      if (a != b)
        return a - b;
    } else if (is_digit(*right)) {
      return -1;
    } else if (*left != *right) {
      return *left - *right;
    } else {
      ++left;
      ++right;
    }
  }
  return *left - *right;
}

static const char *string_at(const char *data, size_t size, uint32_t offset) {
  if (offset >= size || memchr(data + offset, '\0', size - offset) == NULL) {
    fprintf(stderr, "cachesearch: string offset %u out of the cache\n", offset);
    exit(2);
  }
  return data + offset;
}

static void search(const char *data, size_t size, const char *name) {
  const struct header *header = (const struct header *)data;
  const struct entry *entries = (const struct entry *)(data + sizeof *header);
  int left = 0, right = (int)header->nlibs - 1;
  while (left <= right) {
    int middle = (left + right) / 2;
    int order = libcmp(name, string_at(data, size, entries[middle].key));
    if (order == 0) {
      int first = middle;
      while (first > 0 && libcmp(name, string_at(data, size, entries[first - 1].key)) == 0)
        --first;
      for (int i = first; i <= right; ++i) {
        if (i > middle && libcmp(name, string_at(data, size, entries[i].key)) != 0)
          break;
        if (entries[i].flags == 0x0303 || entries[i].flags == 0x0001)
          printf("%d:%llu:%s%c", entries[i].flags, (unsigned long long)entries[i].hwcap,
                 string_at(data, size, entries[i].value), '\0');
      }
      break;
    }
    if (order < 0)
      left = middle + 1;
    else
      right = middle - 1;
  }
  putchar('\0');
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: cachesearch CACHE < names\n");
    return 2;
  }
  FILE *file = fopen(argv[1], "rb");
  if (file == NULL) {
    perror(argv[1]);
    return 2;
  }
  static char data[64 << 20];
  size_t size = fread(data, 1, sizeof data, file);
  fclose(file);
  if (size < sizeof(struct header) || memcmp(data, "glibc-ld.so.cache1.1", 20) != 0 ||
      (size - sizeof(struct header)) / sizeof(struct entry) < ((struct header *)data)->nlibs) {
    fprintf(stderr, "cachesearch: %s is no new-format ld.so.cache\n", argv[1]);
    return 2;
  }
  char *name = NULL;
  size_t length = 0;
  ssize_t got;
  while ((got = getdelim(&name, &length, '\0', stdin)) > 0) {
    if (name[got - 1] != '\0')
      break; /* a last name without its NUL: not a name */
    search(data, size, name);
  }
  free(name);
  return 0;
}
