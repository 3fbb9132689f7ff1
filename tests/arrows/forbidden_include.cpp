// Not compiled: the 'arrows-forbidden' test checks this file as if it were in
// lib/tensor/, and the include check must refuse it (tensor may not use cuda/,
// which sits above it behind the engine).
#include "cuda/runtime.h"
