/*
 * A stand-in libcuda.so.1 for machines WITHOUT a GPU.
 *
 * The PyPI sgl_kernel build is CUDA-only: its shared objects link
 * libcuda.so.1, and SGLang's CPU engine imports them anyway. Python dlopens
 * with RTLD_NOW, so every driver symbol they name must resolve even though
 * none is ever called on a CPU. Each entry point here answers
 * CUDA_ERROR_NO_DEVICE, so anything that does call one fails cleanly and
 * torch.cuda.is_available() stays False.
 *
 * Never put this library in front of a real driver. tasks/server/cpu/shim.py builds
 * it only when no GPU is present; tests/test_cpu_shim.py fails when a new
 * sgl_kernel needs a symbol that is missing below.
 */
#define CUDA_ERROR_NO_DEVICE 100

#define STUB(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }

STUB(cuInit)
STUB(cuDeviceGetCount)
STUB(cuDriverGetVersion)
STUB(cuCtxFromGreenCtx)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc)
STUB(cuDevSmResourceSplitByCount)
STUB(cuDeviceGetDevResource)
STUB(cuGetProcAddress_v2)
STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy)
STUB(cuGreenCtxGetDevResource)
STUB(cuPointerGetAttribute)
STUB(cuStreamCreate)

/* Callers print the string this returns, so it must point somewhere valid. */
int cuGetErrorString(int error, const char **message) {
    (void)error;
    if (message) *message = "no CUDA device (libcuda stub for CPU-only machines)";
    return 0;
}
