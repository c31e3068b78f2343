#include "rle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void)
{
    fprintf(stderr, "usage: rle encode|decode TEXT\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return usage();
    size_t cap = strlen(argv[2]) * 12 + 64;
    char *out = malloc(cap);
    if (out == NULL) {
        perror("rle");
        return 1;
    }
    int n;
    if (strcmp(argv[1], "encode") == 0)
        n = rle_encode(argv[2], out, cap);
    else if (strcmp(argv[1], "decode") == 0)
        n = rle_decode(argv[2], out, cap);
    else {
        free(out);
        return usage();
    }
    if (n < 0) {
        fprintf(stderr, "rle: cannot %s %s\n", argv[1], argv[2]);
        free(out);
        return 1;
    }
    puts(out);
    free(out);
    return 0;
}
