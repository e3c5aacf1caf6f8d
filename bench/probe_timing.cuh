// What the CUDA probes in bench/ (l2_reduction.cu, l2_gather.cu, dsmem_exchange.cu) share: CK, which stops the probe
// with the file and line of a failed CUDA call, and best_ms, the fastest of `reps` timed launches.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

// The fewest milliseconds of `reps` calls of launch() (each between two CUDA events), then a check that no launch
// failed. The caller warms up first.
template <typename Launch>
float best_ms(Launch launch, int reps = 5) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float best = 1e30f;
    for (int rep = 0; rep < reps; ++rep) {
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        best = ms < best ? ms : best;
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    CK(cudaGetLastError());
    return best;
}
