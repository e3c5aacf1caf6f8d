// What the CUDA probes in bench/ (l2_reduction.cu, l2_gather.cu, dsmem_exchange.cu) share: CK, which stops the probe
// with the file and line of a failed CUDA call, best_ms, the fastest of `reps` timed launches, and the two cluster
// helpers of the 2-CTA probes (mapa_peer, mbar_wait_cluster).
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

// The shared::cluster address of shared address `a` in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t mapa_peer(uint32_t a, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}

// Wait until this CTA's mbarrier `bar` completed the phase of `parity`, acquiring what the cluster released into it.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, int parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra W;\n}" :: "r"(bar), "r"(parity) : "memory");
}
