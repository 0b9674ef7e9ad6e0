// Stands in for the CUDA toolkit's cuda_bf16.h in the cuda_sim build (see cuda_sim.h).
#pragma once
#include "cuda_sim.h"
