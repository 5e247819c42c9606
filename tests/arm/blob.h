/* The arrays a test driver reads from stdin and writes to stdout (tests/arm/qemu.py packs and
 * unpacks them): each is an int32 type code (0: float32, 1: int64, 2: uint16, 3: int32), an
 * int64 element count, then the elements, little endian as both ends are. */
#ifndef MOESERVE_TESTS_BLOB_H
#define MOESERVE_TESTS_BLOB_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { BLOB_F32 = 0, BLOB_I64 = 1, BLOB_U16 = 2, BLOB_I32 = 3 };
static const size_t BLOB_SIZE[] = {4, 8, 2, 4};

static void *blob_read(int32_t want, int64_t *count) {
    int32_t code;
    if (fread(&code, 4, 1, stdin) != 1 || fread(count, 8, 1, stdin) != 1 || code != want) {
        fprintf(stderr, "blob: expected an array of type %d\n", want);
        exit(2);
    }
    const size_t size = BLOB_SIZE[code];
    void *data = malloc(*count ? (size_t)*count * size : 1);
    if (fread(data, size, (size_t)*count, stdin) != (size_t)*count) {
        fprintf(stderr, "blob: short array\n");
        exit(2);
    }
    return data;
}

static void blob_write(int32_t code, int64_t count, const void *data) {
    fwrite(&code, 4, 1, stdout);
    fwrite(&count, 8, 1, stdout);
    fwrite(data, BLOB_SIZE[code], (size_t)count, stdout);
}
#endif
