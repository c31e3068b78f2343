#!/bin/bash
# Oracle: fix the Makefile (include path, the missing object) and write rle_encode.
set -euo pipefail
cd /app

sed -i 's|^CFLAGS = .*|CFLAGS = -std=c11 -Wall -Wextra -O2 -Iinclude|' Makefile
sed -i 's|^OBJS = .*|OBJS = build/main.o build/rle.o|' Makefile

python3 - <<'PY'
import re
from pathlib import Path

path = Path("/app/src/rle.c")
source = path.read_text()
encoder = r'''int rle_encode(const char *in, char *out, size_t cap)
{
    size_t used = 0;
    while (*in) {
        char c = *in;
        if (isdigit((unsigned char)c))
            return -1;
        size_t count = 0;
        while (*in == c) {
            count++;
            in++;
        }
        char digits[24];
        int width = snprintf(digits, sizeof digits, "%zu", count);
        if (width < 0 || used + (size_t)width + 2 > cap)
            return -1;
        memcpy(out + used, digits, (size_t)width);
        used += (size_t)width;
        out[used++] = c;
    }
    if (cap == 0)
        return -1;
    out[used] = '\0';
    return (int)used;
}'''
source, replaced = re.subn(r"int rle_encode\(.*?\n\}", lambda _: encoder, source, count=1, flags=re.S)
assert replaced == 1, "rle_encode not found"
source = source.replace("#include <string.h>", "#include <stdio.h>\n#include <string.h>", 1)
path.write_text(source)
PY

make clean
make
