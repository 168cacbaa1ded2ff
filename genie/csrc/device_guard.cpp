// Device guard for the remote_accelerator (PrivateUse1) device.
//
// PyTorch's Python-level guard for a Python backend knows one device only, so
// autograd on remote_accelerator:1 hits an internal assert and set_device is
// ignored. This guard keeps a thread-local current device and stream per the
// DeviceGuardImplInterface contract, reports a device count that covers every
// device Genie connected to (deviceCount never throws), and gives events timestamps. The remote work
// itself is ordered by Genie's streams; these guard-level events are complete
// when recorded, because everything before them was already submitted in order.
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <unordered_map>

namespace {

std::atomic<int> g_device_count{1};
// The autograd engine sizes its per-device queues from deviceCount() once, at the
// first backward of the process; devices connected later (genie.init with more
// daemons) must still fit, so the count it sees never drops below this floor.
constexpr int kDeviceCountFloor = 16;
thread_local c10::DeviceIndex t_device = 0;
thread_local std::unordered_map<c10::DeviceIndex, c10::StreamId> t_streams;
std::atomic<c10::StreamId> g_next_stream{1};

struct GuardEvent {
  double time_ms;
};

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

struct RemoteGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, t_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "expected a remote_accelerator device, got ", d);
    TORCH_CHECK(d.index() >= 0 && d.index() < g_device_count.load(),
                "remote_accelerator:", static_cast<int>(d.index()), " does not exist (",
                g_device_count.load(), " connected)");
    t_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_device = d.index(); }

  c10::Stream getStream(c10::Device d) const override {
    auto it = t_streams.find(d.index());
    c10::StreamId id = it == t_streams.end() ? 0 : it->second;
    return c10::Stream(c10::Stream::UNSAFE, d, id);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    t_streams[s.device_index()] = s.id();
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    int n = g_device_count.load();
    return static_cast<c10::DeviceIndex>(n > kDeviceCountFloor ? n : kDeviceCountFloor);
  }

  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new GuardEvent{0.0};
    static_cast<GuardEvent*>(*event)->time_ms = now_ms();
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<GuardEvent*>(event);
  }
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start && end, "both events must be recorded");
    return static_cast<GuardEvent*>(end)->time_ms - static_cast<GuardEvent*>(start)->time_ms;
  }
};

// Backend hooks. PyTorch makes a registered PrivateUse1 backend the current accelerator, so
// `t.pin_memory()` and DataLoader(pin_memory=True) ask these hooks for pinned memory. A remote
// device needs none; page-locked memory still helps local CUDA copies, so: CUDA's pinned
// allocator where this process has a GPU (the same buffers `torch.cuda` would give), else
// ordinary host memory (is_pinned() stays false, as with PyTorch on a machine without one).
struct RemoteHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  void init() const override {}
  bool isPinnedPtr(const void* data) const override {
    const auto& cuda = at::detail::getCUDAHooks();
    return cuda.hasCUDA() && cuda.isPinnedPtr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    const auto& cuda = at::detail::getCUDAHooks();
    return cuda.hasCUDA() ? cuda.getPinnedMemoryAllocator() : c10::GetCPUAllocator();
  }
  // A generator object here could not drive the daemon's random streams: say what does.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(false, kNoGenerator);
  }
  at::Generator getNewGenerator(c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(false, kNoGenerator);
  }
  static constexpr const char* kNoGenerator =
      "torch.Generator(device=\"remote_accelerator\") is not supported: random numbers are drawn on the "
      "daemon, from this client's generator there. Seed it with torch.manual_seed(s) or "
      "torch.remote_accelerator.manual_seed(s), and draw without a generator= argument";
};

// Storage for remote_accelerator tensors lives on a daemon: this process has none to hand out.
// Without an allocator registered for the device, PyTorch used a null one and the process
// crashed (torch.UntypedStorage(n, device=...), torch.load(f, map_location="remote_accelerator")).
// Remote tensors never reach it: they are wrappers whose metadata-only storage PyTorch makes itself.
constexpr const char* kNoStorage =
    "remote_accelerator tensors live on a genie-daemon; this process cannot allocate or copy "
    "storage for them (torch.UntypedStorage on the device, torch.load(..., map_location=...)). "
    "Load to the CPU and move the tensors instead: torch.load(f, map_location=\"cpu\"), then "
    ".to(\"remote_accelerator\") or model.load_state_dict(...)";

struct NoStorageAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t /*n*/) override { TORCH_CHECK(false, kNoStorage); }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {
    TORCH_CHECK(false, kNoStorage);
  }
};

}  // namespace

extern "C" {
// Registers the hooks above for PrivateUse1: 0 on success, 1 if PyTorch refused (hooks already
// registered). Call before anything registers other hooks (they can be registered only once).
int genie_install_hooks() {
  try {
    at::RegisterPrivateUse1HooksInterface(new RemoteHooks());  // leaked on purpose, like the guard
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
// Called by Genie after (re)connecting: the number of remote devices.
void genie_set_device_count(int n) { g_device_count.store(n > 0 ? n : 1); }
// Installs this guard for PrivateUse1, replacing the one-device Python guard.
void genie_install_guard() {
  // Registry entries are leaked on purpose (see DeviceGuardImplInterface.h).
  static c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::PrivateUse1, new RemoteGuardImpl());
  static NoStorageAllocator no_storage;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &no_storage);
}
}
