/* The native kernels in one library (one helper thread for all: pool.h), built and bound by
   backends/cpu/native_build.py: decode attention (backends/cpu/native_attention.py) and row products
   (backends/cpu/native_products.py), TurboQuant's decode-sized coder (backends/cpu/turboquant_host.py). */
#include "pool.h"
#include "decode_attention.c"
#include "row_products.c"
#include "turboquant_code.c"
