/* Run-length encoding of text: "aaabcc" <-> "3a1b2c". */
#ifndef RLE_H
#define RLE_H

#include <stddef.h>

/*
 * Encode the NUL-terminated string `in` into `out`, a buffer of `cap` bytes.
 *
 * Each maximal run of one character c repeated n times becomes the decimal
 * number n (no leading zeros) followed by c. The result is NUL-terminated.
 *
 * Returns the length of the encoded text (the NUL not counted), or -1 when
 *   - `in` contains a decimal digit ('0'..'9'), which the format cannot carry, or
 *   - the encoded text and its NUL do not fit in `cap` bytes.
 * On -1 the contents of `out` are unspecified. An empty `in` encodes to "".
 */
int rle_encode(const char *in, char *out, size_t cap);

/*
 * The inverse of rle_encode: decode `in` into `out` (`cap` bytes, NUL included).
 * Returns the decoded length, or -1 when `in` is malformed or the result does
 * not fit.
 */
int rle_decode(const char *in, char *out, size_t cap);

#endif
