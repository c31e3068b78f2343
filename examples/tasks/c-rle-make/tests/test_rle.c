/* Verifier's own checks of rle_encode, linked against /app/src/rle.c. */
#include "rle.h"

#include <stdio.h>
#include <string.h>

static int failures = 0;

static void expect_encode(const char *in, size_t cap, int want_n, const char *want)
{
    char out[256];
    memset(out, 'X', sizeof out);
    int n = rle_encode(in, out, cap);
    if (n != want_n || (want != NULL && strcmp(out, want) != 0)) {
        printf("FAIL rle_encode(\"%s\", cap=%zu) = %d \"%.40s\"; want %d \"%s\"\n",
               in, cap, n, n >= 0 ? out : "", want_n, want ? want : "");
        failures++;
    }
}

static void expect_round_trip(const char *in)
{
    char enc[256], dec[256];
    int n = rle_encode(in, enc, sizeof enc);
    int m = n < 0 ? -1 : rle_decode(enc, dec, sizeof dec);
    if (m < 0 || strcmp(dec, in) != 0) {
        printf("FAIL round trip of \"%s\"\n", in);
        failures++;
    }
}

int main(void)
{
    expect_encode("aaabccdddd", 64, 8, "3a1b2c4d");
    expect_encode("", 64, 0, "");
    expect_encode("", 1, 0, "");
    expect_encode("q", 64, 2, "1q");
    expect_encode("zzzzzzzzzzzz", 64, 3, "12z");
    expect_encode("  --  ", 64, 6, "2 2-2 ");
    expect_encode("abcabc", 64, 12, "1a1b1c1a1b1c");
    /* Capacity: "3a1b" needs 5 bytes with its NUL. */
    expect_encode("aaab", 5, 4, "3a1b");
    expect_encode("aaab", 4, -1, NULL);
    expect_encode("aaab", 0, -1, NULL);
    /* Digits cannot be encoded. */
    expect_encode("ab1", 64, -1, NULL);
    expect_encode("9", 64, -1, NULL);

    char many[201];
    memset(many, 'k', 200);
    many[200] = '\0';
    expect_encode(many, 64, 4, "200k");

    expect_round_trip("hello,  world!!!");
    expect_round_trip("xyyzzz____");
    expect_round_trip(many);

    if (failures == 0)
        printf("all rle_encode checks passed\n");
    return failures == 0 ? 0 : 1;
}
