#include "rle.h"

#include <ctype.h>
#include <string.h>

int rle_encode(const char *in, char *out, size_t cap)
{
    /* TODO: not written yet. */
    (void)in;
    (void)out;
    (void)cap;
    return -1;
}

int rle_decode(const char *in, char *out, size_t cap)
{
    size_t used = 0;
    while (*in) {
        if (!isdigit((unsigned char)*in) || *in == '0')
            return -1;
        size_t count = 0;
        while (isdigit((unsigned char)*in)) {
            count = count * 10 + (size_t)(*in - '0');
            if (count > cap)
                return -1;
            in++;
        }
        if (*in == '\0')
            return -1;
        if (used + count + 1 > cap)
            return -1;
        memset(out + used, *in, count);
        used += count;
        in++;
    }
    if (cap == 0)
        return -1;
    out[used] = '\0';
    return (int)used;
}
