// A no-op device guard for CUDA, for a torch built without CUDA (tandem/host_syncs.py,
// fake_cuda). Loaded only where torch has no CUDA guard of its own: it lets FakeTensorMode
// index, slice and move "cuda" tensors (torch's Python bindings open a device guard for
// them), as torch's own ensureCUDADeviceGuardSet does on a CUDA build without a device.
#include <c10/core/impl/DeviceGuardImplInterface.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
