// Row gathers from an L2-resident pool into shared memory, the way the sparse kernels gather their KV / key rows:
// the rate of 16-byte `cp.async` (the kernels' producers) against per-row TMA tile loads (`cp.async.bulk.tensor`, one
// 128-byte box per 64-column block, 128B-swizzled like the wgmma operand tiles) and against plain 16-byte loads into
// registers (no shared memory: the L2 -> SM read ceiling), with random row ids (GPU, sm_90a).
//
//     nvcc -O3 -arch=sm_90a -o /tmp/l2_gather bench/l2_gather.cu && \
//         /tmp/l2_gather [slots [seconds [variants [row_bytes]]]]
//
// seconds > 0 adds each variant's energy (probe_energy.cuh: J per launch, pJ per delivered byte, total and above
// the idle board); variants (comma-separated names) and row_bytes restrict the run.
//
// Each of `slots` (default 8M: T 4096 x top-k 2048) gathers row ids[slot] of a pool of `rows` rows (32768 and
// 131072) of `row_bytes` bytes (256: the indexer's D 128 bf16; 1024: D 512; 1152: D 576) in 64-row tiles into a ring
// of `stages` (2..4) shared tiles per CTA, one CTA per SM. Variants:
//   cpasync/<W>  W warps issue the tile's 16-byte cp.async (8 lanes per row, the kernels' pattern), commit, and wait
//                for the tile `stages - 1` back (W = 4 is the kernels' producer warpgroup); 16x2: two such CTAs per SM;
//   tma/<L>      L lanes of one warp issue the tile's box loads (row_bytes / 128 per row) on the stage's mbarrier and
//                wait for it `stages` tiles later;
//   ldg/<W>      W warps load the rows with ld.global.v4 into registers (no shared memory);
//   pair/4       2-CTA clusters of 4 warps that share each tile: a CTA gathers half of the tile's rows with
//                cp.async into its stage, waits for them and forwards them with st.async into the same place of
//                its partner's stage (completing the partner's mbarrier), so that each row crosses from L2 once for
//                both CTAs: how a 2-CTA sparse MLA backward (a row's two head blocks) could halve its gathered bytes.
//                GB/s counts the rows delivered to both CTAs (2 x slots rows).
// Prints ms and GB/s of gathered bytes; a one-tile run of cpasync/4 and tma/32 (with one invalid id: zero-filled) is
// checked against the pool, swizzle included.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <random>
#include <string>
#include <cuda.h>
#include <cuda_runtime.h>
#include "probe_energy.cuh"

constexpr int kTileRows = 64;
constexpr int kMaxSmem = 220 * 1024;         // dynamic shared memory of a CTA (the tma kernel has 32 B static)

// byte offset of 16-byte chunk c of row r, 64-column block kb, in a (64 rows, D) K-major 128B-swizzled tile
__device__ __forceinline__ uint32_t sw_off(int r, int kb, int c) {
    return kb * (kTileRows * 128) + r * 128 + ((c ^ (r % 8)) * 16);
}

// Chunk c8 of every 128-byte block of pool row `id` (zero-filled for id < 0) into row r of the swizzled tile at st.
__device__ __forceinline__ void cp_async_row_chunks(uint32_t st, int r, const uint8_t* pool, int id, int row_bytes,
                                                    int c8) {
    const bool ok = id >= 0;
    const uint8_t* src = pool + (long)(ok ? id : 0) * row_bytes;
    for (int kb = 0; kb < row_bytes / 128; ++kb)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(st + sw_off(r, kb, c8)), "l"(src + kb * 128 + c8 * 16), "r"(ok ? 16 : 0) : "memory");
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 2)
gather_cpasync(const uint8_t* pool, const int* ids, long slots, int row_bytes, int stages, uint8_t* dump) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const int tid = threadIdx.x, grp = tid / 8, c8 = tid % 8;
    constexpr int kGroups = kWarps * 4;                 // rows per pass
    const int tile_bytes = kTileRows * row_bytes;
    const long ntiles = slots / kTileRows;
    constexpr int kRowsPerThread = (kTileRows + kGroups - 1) / kGroups;
    int id[kRowsPerThread], id_next[kRowsPerThread];
    auto load_ids = [&](long t, int* dst) {             // the tile's ids, loaded a tile ahead as in the kernels
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int r = grp + kGroups * i;
            dst[i] = (t < ntiles && r < kTileRows) ? ids[t * kTileRows + r] : -1;
        }
    };
    load_ids(blockIdx.x, id);
    int n = 0;
    for (long t = blockIdx.x; t < ntiles; t += gridDim.x, ++n) {
        load_ids(t + gridDim.x, id_next);
        const uint32_t st = (uint32_t)__cvta_generic_to_shared(smem + (n % stages) * tile_bytes);
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int r = grp + kGroups * i;
            if (r >= kTileRows) break;
            cp_async_row_chunks(st, r, pool, id[i], row_bytes, c8);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (stages == 2) asm volatile("cp.async.wait_group 1;" ::: "memory");
        else if (stages == 3) asm volatile("cp.async.wait_group 2;" ::: "memory");
        else asm volatile("cp.async.wait_group 3;" ::: "memory");
        for (int i = 0; i < kRowsPerThread; ++i) id[i] = id_next[i];
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (dump != nullptr && blockIdx.x == 0)
        for (int i = tid; i < tile_bytes; i += blockDim.x) dump[i] = smem[i];
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
                 :: "r"(bar), "r"(parity) : "memory");
}

// pair/4: cluster (2, 1, 1); both CTAs of a cluster walk the same tiles. Per tile and stage s: full[s] completes when
// this CTA's 128 threads have their own half in place (one arrive each after cp.async.wait_group 0) and the
// partner's half has landed (thread 0's expect_tx, the partner's st.async complete_tx); empty[s] completes when the
// partner saw its full[s] of the stage's previous tile, i.e. may be written again.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128, 1)
gather_pair(const uint8_t* pool, const int* ids, long slots, int row_bytes, int stages, uint8_t* dump) {
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ __align__(8) uint64_t full[4], empty[4];
    const int tid = threadIdx.x, grp = tid / 8, c8 = tid % 8;
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const uint32_t peer = rank ^ 1;
    const int tile_bytes = kTileRows * row_bytes, nkb = row_bytes / 128;
    const long ntiles = slots / kTileRows, cluster = blockIdx.x / 2, nclusters = gridDim.x / 2;
    const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(full), empty0 = (uint32_t)__cvta_generic_to_shared(empty);
    if (tid == 0) {
        for (int s = 0; s < stages; ++s) { mbar_init(full0 + 8 * s, 129); mbar_init(empty0 + 8 * s, 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    constexpr int kRows = kTileRows / 32;               // this CTA's rows of a tile per thread: grp + 16 (2 rank + i)
    int id[kRows], id_next[kRows];
    auto load_ids = [&](long t, int* dst) {
        for (int i = 0; i < kRows; ++i) dst[i] = t < ntiles ? ids[t * kTileRows + grp + 16 * (2 * rank + i)] : -1;
    };
    load_ids(cluster, id);
    int n = 0;
    for (long t = cluster; t < ntiles; t += nclusters, ++n) {
        load_ids(t + nclusters, id_next);
        const int s = n % stages;
        if (n >= stages) {
            const int parity = ((n / stages) - 1) & 1;
            mbar_wait_cluster(full0 + 8 * s, parity);              // this CTA's stage s holds the old tile whole
            if (tid == 0)                                          // ... so the partner may write into it again
                asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
                             :: "r"(mapa_peer(empty0 + 8 * s, peer)) : "memory");
            mbar_wait_cluster(empty0 + 8 * s, parity);             // the partner's stage s is free
        }
        if (tid == 0) mbar_expect_tx(full0 + 8 * s, tile_bytes / 2);
        const uint32_t st = (uint32_t)__cvta_generic_to_shared(smem + s * tile_bytes);
        for (int i = 0; i < kRows; ++i) cp_async_row_chunks(st, grp + 16 * (2 * rank + i), pool, id[i], row_bytes, c8);
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        const uint32_t pst = mapa_peer(st, peer), pfull = mapa_peer(full0 + 8 * s, peer);
        for (int i = 0; i < kRows; ++i) {
            const int r = grp + 16 * (2 * rank + i);
            for (int kb = 0; kb < nkb; ++kb) {
                const uint32_t off = sw_off(r, kb, c8);
                uint32_t a, b, c, d;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                             : "r"(st + off) : "memory");
                asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32"
                             " [%0], {%1, %2, %3, %4}, [%5];"
                             :: "r"(pst + off), "r"(a), "r"(b), "r"(c), "r"(d), "r"(pfull) : "memory");
            }
        }
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(full0 + 8 * s) : "memory");
        for (int i = 0; i < kRows; ++i) id[i] = id_next[i];
    }
    for (int k = (n > stages ? n - stages : 0); k < n; ++k)
        mbar_wait_cluster(full0 + 8 * (k % stages), (k / stages) & 1);
    // the partner may still be writing into this CTA's stages until it saw its own last tiles whole
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (dump != nullptr && blockIdx.x == 0)
        for (int i = tid; i < tile_bytes; i += blockDim.x) dump[i] = smem[i];
}

template <int kLanes>
__global__ void __launch_bounds__(32, 1)
gather_tma(const __grid_constant__ CUtensorMap map, const int* ids, long slots, int row_bytes, int stages,
           uint8_t* dump) {
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ __align__(8) uint64_t full[4];
    const int lane = threadIdx.x;
    const int tile_bytes = kTileRows * row_bytes, nkb = row_bytes / 128;
    const long ntiles = slots / kTileRows;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(full);
    if (lane == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    int n = 0;
    for (long t = blockIdx.x; t < ntiles; t += gridDim.x, ++n) {
        const int s = n % stages;
        const uint32_t bar = bar0 + 8 * s;
        if (n >= stages) mbar_wait(bar, ((n / stages) - 1) & 1);      // the stage's previous tile landed
        if (lane == 0) mbar_expect_tx(bar, tile_bytes);
        __syncwarp();
        const uint32_t st = (uint32_t)__cvta_generic_to_shared(smem + s * tile_bytes);
        if (lane < kLanes) {
            int tile_ids[kTileRows / kLanes];
            for (int i = 0; i < kTileRows / kLanes; ++i) tile_ids[i] = ids[t * kTileRows + lane + kLanes * i];
            for (int i = 0; i < kTileRows / kLanes; ++i) {
                const int r = lane + kLanes * i, id = tile_ids[i];    // -1: out of the map's bounds, zero-filled
                for (int kb = 0; kb < nkb; ++kb)
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%2, %3}], [%4];"
                                 :: "r"(st + kb * (kTileRows * 128) + r * 128), "l"(&map), "r"(kb * 64), "r"(id),
                                    "r"(bar) : "memory");
            }
        }
    }
    for (int k = (n > stages ? n - stages : 0); k < n; ++k) mbar_wait(bar0 + 8 * (k % stages), (k / stages) & 1);
    __syncwarp();
    if (dump != nullptr && blockIdx.x == 0)
        for (int i = lane; i < tile_bytes; i += 32) dump[i] = smem[i];
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
gather_ldg(const uint8_t* pool, const int* ids, long slots, int row_bytes, uint32_t* sink) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int lanes_per_row = row_bytes / 16 < 32 ? row_bytes / 16 : 32;   // 256 B: 16 lanes, 2 rows at once
    const int rows_at_once = 32 / lanes_per_row;
    uint32_t x = 0;
    const long gw = (long)blockIdx.x * kWarps + warp, nw = (long)gridDim.x * kWarps;
    for (long s0 = gw * rows_at_once; s0 < slots; s0 += nw * rows_at_once) {
        const long s = s0 + lane / lanes_per_row;
        const uint4* row = reinterpret_cast<const uint4*>(pool + (long)ids[s] * row_bytes);
        for (int c = lane % lanes_per_row; c < row_bytes / 16; c += lanes_per_row) {
            uint4 v;
            asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(row + c));
            x ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (x == 0x12345678u) sink[0] = x;
}

static CUtensorMap make_map(void* pool, long rows, int row_bytes) {
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)(row_bytes / 2), (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    cuuint32_t box[2] = {64, 1}, elem[2] = {1, 1};
    // the driver entry point through the runtime, so that the binary needs no -lcuda
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static Encode encode = nullptr;
    if (encode == nullptr) {
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                            cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess) { printf("no cuTensorMapEncodeTiled\n"); exit(1); }
    }
    CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, pool, dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled failed: %d\n", (int)r); exit(1); }
    return m;
}

// the one-tile dump of a variant against the pool: chunk c of block kb of row r at its swizzled place, zeros at id -1
static bool check_dump(const std::vector<uint8_t>& pool, const std::vector<int>& ids, const std::vector<uint8_t>& dump,
                       int row_bytes) {
    for (int r = 0; r < kTileRows; ++r)
        for (int kb = 0; kb < row_bytes / 128; ++kb)
            for (int c = 0; c < 8; ++c)
                for (int b = 0; b < 16; ++b) {
                    const uint8_t got = dump[kb * kTileRows * 128 + r * 128 + (c ^ (r % 8)) * 16 + b];
                    const uint8_t want = ids[r] < 0 ? 0 : pool[(long)ids[r] * row_bytes + kb * 128 + c * 16 + b];
                    if (got != want) return false;
                }
    return true;
}

int main(int argc, char** argv) {
    const long slots = argc > 1 ? atol(argv[1]) : 4096L * 2048;
    const double energy_seconds = argc > 2 ? atof(argv[2]) : 0.0;
    const std::string only = argc > 3 ? "," + std::string(argv[3]) + "," : "";
    const int only_row_bytes = argc > 4 ? atoi(argv[4]) : 0;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# %s, %d SMs, L2 %d MB; %ld slots, 64-row tiles, one CTA per SM\n", prop.name, sms,
           prop.l2CacheSize >> 20, slots);
    CK(cudaFuncSetAttribute(gather_cpasync<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    CK(cudaFuncSetAttribute(gather_cpasync<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    CK(cudaFuncSetAttribute(gather_cpasync<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    CK(cudaFuncSetAttribute(gather_pair, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    CK(cudaFuncSetAttribute(gather_tma<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    CK(cudaFuncSetAttribute(gather_tma<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    int* d_ids;
    CK(cudaMalloc(&d_ids, slots * sizeof(int)));
    uint8_t* d_dump;
    CK(cudaMalloc(&d_dump, kTileRows * 1152));
    uint32_t* d_sink;
    CK(cudaMalloc(&d_sink, 4));
    const EnergyProbe energy(energy_seconds);
    printf("%7s %6s %6s %-12s %8s %8s %s%s\n", "row B", "rows", "stages", "variant", "ms", "GB/s", "check",
           energy.columns());
    for (int row_bytes : {256, 1024, 1152}) {
        if (only_row_bytes != 0 && row_bytes != only_row_bytes) continue;
        for (long rows : {32768L, 131072L}) {
            std::vector<uint8_t> pool((size_t)rows * row_bytes);
            std::mt19937 gen(7 + row_bytes);
            for (auto& b : pool) b = (uint8_t)gen();
            uint8_t* d_pool;
            CK(cudaMalloc(&d_pool, pool.size()));
            CK(cudaMemcpy(d_pool, pool.data(), pool.size(), cudaMemcpyHostToDevice));
            std::vector<int> ids(slots);
            std::uniform_int_distribution<int> pick(0, (int)rows - 1);
            for (long i = 0; i < slots; ++i) ids[i] = pick(gen);
            std::vector<int> check_ids(ids.begin(), ids.begin() + kTileRows);
            check_ids[5] = -1;
            CK(cudaMemcpy(d_ids, check_ids.data(), kTileRows * sizeof(int), cudaMemcpyHostToDevice));
            const CUtensorMap map = make_map(d_pool, rows, row_bytes);
            const int tile_bytes = kTileRows * row_bytes;
            std::vector<uint8_t> dump(tile_bytes);
            CK(cudaMemset(d_dump, 0xff, tile_bytes));
            gather_cpasync<4><<<1, 128, 2 * tile_bytes>>>(d_pool, d_ids, kTileRows, row_bytes, 2, d_dump);
            CK(cudaMemcpy(dump.data(), d_dump, tile_bytes, cudaMemcpyDeviceToHost));
            const bool ok_cp = check_dump(pool, check_ids, dump, row_bytes);
            CK(cudaMemset(d_dump, 0xff, tile_bytes));
            gather_tma<32><<<1, 32, 2 * tile_bytes>>>(map, d_ids, kTileRows, row_bytes, 2, d_dump);
            CK(cudaMemcpy(dump.data(), d_dump, tile_bytes, cudaMemcpyDeviceToHost));
            const bool ok_tma = check_dump(pool, check_ids, dump, row_bytes);
            // pair/4 on one cluster and one tile: the dump is CTA 0's stage, whose odd row groups came from CTA 1
            CK(cudaMemset(d_dump, 0xff, tile_bytes));
            gather_pair<<<2, 128, 2 * tile_bytes>>>(d_pool, d_ids, kTileRows, row_bytes, 2, d_dump);
            CK(cudaMemcpy(dump.data(), d_dump, tile_bytes, cudaMemcpyDeviceToHost));
            const bool ok_pair = check_dump(pool, check_ids, dump, row_bytes);
            CK(cudaMemcpy(d_ids, ids.data(), slots * sizeof(int), cudaMemcpyHostToDevice));
            const int max_stages = kMaxSmem / tile_bytes < 4 ? kMaxSmem / tile_bytes : 4;
            for (int stages = 2; stages <= max_stages; ++stages) {
                for (const char* name : {"cpasync/4", "cpasync/8", "cpasync/16", "cpasync/16x2", "pair/4", "tma/1",
                                         "tma/32", "ldg/8", "ldg/32"}) {
                    const std::string v(name);
                    if (!only.empty() && only.find("," + v + ",") == std::string::npos) continue;
                    if ((v.rfind("ldg", 0) == 0 || v == "tma/1") && stages > 2) continue;
                    if (v == "cpasync/16x2" && 2 * (size_t)stages * tile_bytes > (size_t)kMaxSmem) continue;
                    const size_t smem = (size_t)stages * tile_bytes;
                    auto launch = [&]() {
                        if (v == "cpasync/4")
                            gather_cpasync<4><<<sms, 128, smem>>>(d_pool, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "cpasync/8")
                            gather_cpasync<8><<<sms, 256, smem>>>(d_pool, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "cpasync/16")
                            gather_cpasync<16><<<sms, 512, smem>>>(d_pool, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "cpasync/16x2")   // two CTAs per SM
                            gather_cpasync<16><<<2 * sms, 512, smem>>>(d_pool, d_ids, slots, row_bytes, stages,
                                                                      nullptr);
                        else if (v == "pair/4")
                            gather_pair<<<sms / 2 * 2, 128, smem>>>(d_pool, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "tma/1")
                            gather_tma<1><<<sms, 32, smem>>>(map, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "tma/32")
                            gather_tma<32><<<sms, 32, smem>>>(map, d_ids, slots, row_bytes, stages, nullptr);
                        else if (v == "ldg/8")
                            gather_ldg<8><<<sms, 256>>>(d_pool, d_ids, slots, row_bytes, d_sink);
                        else
                            gather_ldg<32><<<sms, 1024>>>(d_pool, d_ids, slots, row_bytes, d_sink);
                    };
                    launch();
                    CK(cudaDeviceSynchronize());
                    const float best = best_ms(launch);
                    const char* check = v.rfind("cpasync", 0) == 0 ? (ok_cp ? "ok" : "WRONG")
                                      : v.rfind("tma", 0) == 0 ? (ok_tma ? "ok" : "WRONG")
                                      : v == "pair/4" ? (ok_pair ? "ok" : "WRONG") : "-";
                    const double bytes = slots * (double)row_bytes * (v == "pair/4" ? 2 : 1);
                    printf("%7d %6ld %6d %-12s %8.3f %8.1f %s", row_bytes, rows, stages, name, best, bytes / best / 1e6,
                           check);
                    energy.print(launch, bytes);
                    printf("\n");
                }
            }
            CK(cudaFree(d_pool));
        }
    }
    return 0;
}
