/* The native kernels in one library (one helper thread for all: pool.h), built and bound by
   models/native_build.py: decode attention (models/native_attention.py) and row products
   (models/native_products.py). */
#include "pool.h"
#include "decode_attention.c"
#include "row_products.c"
