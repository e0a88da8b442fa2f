// wsched device primitives: include everything (namespace wsp).
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "sync.cuh"
#include "wgmma.cuh"
#include "stmatrix.cuh"
#include "math.cuh"
