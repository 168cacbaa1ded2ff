// Device guard for the remote_accelerator (PrivateUse1) device.
//
// PyTorch's Python-level guard for a Python backend knows one device only, so
// autograd on remote_accelerator:1 hits an internal assert and set_device is
// ignored. This guard keeps a thread-local current device and stream per the
// DeviceGuardImplInterface contract, reports a device count that covers every
// device Genie connected to (deviceCount never throws), and gives events timestamps. The remote work
// itself is ordered by Genie's streams; these guard-level events are complete
// when recorded, because everything before them was already submitted in order.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Generator.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

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

// A torch.Generator(device="remote_accelerator"). Its random stream lives on the daemon: this
// object holds what the client knows, a seed and a count of (re)seedings, under an id unique in
// this process. Genie reads them (genie_generator_info) when an op draws from the generator and,
// when the count moved since the daemon last heard, queues a seed for the daemon's twin first.
// Its position in the stream exists only on the daemon: get_state/set_state ask Genie's Python
// side (hooks registered by genie_set_generator_state_hooks) to read or set the twin's state in
// program order; offsets and clones are refused.
std::atomic<int64_t> g_next_generator{1};
// torch.Generator() starts from this seed on every device (CPU and CUDA alike): so does this one.
constexpr uint64_t kDefaultSeed = 67280421310721ULL;
constexpr const char* kNoGeneratorState =
    "a remote_accelerator generator's position lives on the genie-daemon: offsets and clones are "
    "not supported. Save and restore it with get_state()/set_state(), or re-seed it with manual_seed(s)";
constexpr const char* kNoStateHooks =
    "remote_accelerator generator state needs Genie's device module (import genie)";

// get(id, seedings, seed, device index) -> bytes; set(id, seedings, seed, device index, bytes).
// Borrowed: genie.frontend.device keeps both alive for the life of the process.
PyObject* g_get_state_hook = nullptr;
PyObject* g_set_state_hook = nullptr;

// Holds the GIL for a call into the hooks (THPGenerator's methods hold it already; other C++
// callers may not). Released on every way out, exceptions included.
struct GilHeld {
  PyGILState_STATE state = PyGILState_Ensure();
  ~GilHeld() { PyGILState_Release(state); }
};

// The pending Python exception of a hook, as a c10::Error (a RuntimeError to the program) with
// its message. The GIL is held.
[[noreturn]] void throw_hook_error() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  std::string message = "remote_accelerator generator state: the hook failed";
  if (value != nullptr) {
    if (PyObject* text = PyObject_Str(value)) {
      if (const char* utf8 = PyUnicode_AsUTF8(text)) message = utf8;
      Py_DECREF(text);
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  TORCH_CHECK(false, message);
}

// Ids of generators destroyed since Genie last asked (genie_generators_dropped): their twins
// on the daemons can go. (Python wrappers of one generator come and go, so only this side knows.)
std::mutex g_dropped_mutex;
std::vector<int64_t> g_dropped;

struct RemoteGeneratorImpl final : public c10::GeneratorImpl {
  explicit RemoteGeneratorImpl(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        uid(g_next_generator.fetch_add(1)) {}
  ~RemoteGeneratorImpl() override {
    std::lock_guard<std::mutex> lock(g_dropped_mutex);
    g_dropped.push_back(uid);
  }

  void set_current_seed(uint64_t s) override {
    seed_.store(s);
    version.fetch_add(1);
  }
  uint64_t current_seed() const override { return seed_.load(); }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  void set_offset(uint64_t /*offset*/) override { TORCH_CHECK(false, kNoGeneratorState); }
  uint64_t get_offset() const override { TORCH_CHECK(false, kNoGeneratorState); }
  // The twin's state, after every op queued before this call (a CPU uint8 tensor, as CUDA's is).
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    TORCH_CHECK(g_get_state_hook != nullptr, kNoStateHooks);
    GilHeld gil;
    PyObject* answer = PyObject_CallFunction(
        g_get_state_hook, "LLKi", static_cast<long long>(uid), static_cast<long long>(version.load()),
        static_cast<unsigned long long>(current_seed()), static_cast<int>(device().index()));
    if (answer == nullptr) throw_hook_error();
    char* bytes = nullptr;
    Py_ssize_t n = 0;
    if (PyBytes_AsStringAndSize(answer, &bytes, &n) != 0) {
      Py_DECREF(answer);
      throw_hook_error();
    }
    at::TensorBase state = at::detail::empty_cpu({static_cast<int64_t>(n)}, c10::ScalarType::Byte);
    std::memcpy(state.mutable_data_ptr(), bytes, static_cast<size_t>(n));
    Py_DECREF(answer);
    return state.getIntrusivePtr();
  }
  // Queues the twin's new state after the ops queued so far (PyTorch checked it is a ByteTensor).
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(g_set_state_hook != nullptr, kNoStateHooks);
    TORCH_CHECK(state.device().is_cpu() && state.dtype().itemsize() == 1 && state.is_contiguous(),
                "a generator state is a contiguous CPU uint8 tensor, as get_state() returns");
    GilHeld gil;
    PyObject* bytes = PyBytes_FromStringAndSize(static_cast<const char*>(state.data()),
                                                static_cast<Py_ssize_t>(state.numel()));
    if (bytes == nullptr) throw_hook_error();
    PyObject* answer = PyObject_CallFunction(
        g_set_state_hook, "LLKiO", static_cast<long long>(uid), static_cast<long long>(version.load()),
        static_cast<unsigned long long>(current_seed()), static_cast<int>(device().index()), bytes);
    Py_DECREF(bytes);
    if (answer == nullptr) throw_hook_error();
    Py_DECREF(answer);
  }
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  const int64_t uid;
  std::atomic<int64_t> version{1};  // 1: the daemon has not heard the starting seed yet

 private:
  RemoteGeneratorImpl* clone_impl() const override { TORCH_CHECK(false, kNoGeneratorState); }
  std::atomic<uint64_t> seed_{kDefaultSeed};
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
  // The default generator is this client's on the daemon, driven by torch.manual_seed and
  // torch.remote_accelerator.{manual_seed,get_rng_state,set_rng_state}; no object here stands for it.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(false, kNoDefaultGenerator);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    // The index is checked where the generator is used: daemons may not be connected yet.
    return at::make_generator<RemoteGeneratorImpl>(device_index < 0 ? t_device : device_index);
  }
  static constexpr const char* kNoDefaultGenerator =
      "remote_accelerator's default generator lives on the genie-daemon: seed it with "
      "torch.manual_seed(s) or torch.remote_accelerator.manual_seed(s), save and restore it with "
      "torch.remote_accelerator.get_rng_state() / set_rng_state(), or make your own with "
      "torch.Generator(device=\"remote_accelerator\")";
};

// Storage for remote_accelerator tensors lives on a daemon: this process has none to hand out.
// Without an allocator registered for the device, PyTorch used a null one and the process
// crashed (torch.UntypedStorage(n, device=...); torch.load(f, map_location="remote_accelerator")
// before genie/frontend/serialization.py handled it).
// Remote tensors never reach it: they are wrappers whose metadata-only storage PyTorch makes itself.
constexpr const char* kNoStorage =
    "remote_accelerator tensors live on a genie-daemon; this process cannot allocate or copy "
    "storage for them (torch.UntypedStorage on the device, storage.to(device=...), a map_location "
    "function moving storages). Give torch.load the device itself: torch.load(f, "
    "map_location=\"remote_accelerator\") (or a torch.device, or a dict naming it), or load to the "
    "CPU and move the tensors with .to(\"remote_accelerator\") or model.load_state_dict(...)";

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
// What Genie needs of a torch.Generator (the Python object) an op draws from: out = [id, number of
// seedings, seed's bits]. 0 for a remote_accelerator generator, 1 for any other (out untouched).
// The caller passes a live torch.Generator and holds the GIL.
int genie_generator_info(PyObject* generator, int64_t* out) {
  const at::Generator& gen = reinterpret_cast<THPGenerator*>(generator)->cdata;
  if (!gen.defined() || gen.device().type() != c10::DeviceType::PrivateUse1) return 1;
  auto* impl = dynamic_cast<RemoteGeneratorImpl*>(gen.unsafeGetGeneratorImpl());
  if (impl == nullptr) return 1;
  out[0] = impl->uid;
  out[1] = impl->version.load();
  out[2] = static_cast<int64_t>(impl->current_seed());
  return 0;
}
// Moves up to `capacity` ids of destroyed generators into `out`; how many it moved.
int genie_generators_dropped(int64_t* out, int capacity) {
  std::lock_guard<std::mutex> lock(g_dropped_mutex);
  int n = 0;
  while (n < capacity && !g_dropped.empty()) {
    out[n++] = g_dropped.back();
    g_dropped.pop_back();
  }
  return n;
}
// Genie's Python functions behind get_state/set_state (borrowed: the caller keeps them alive).
void genie_set_generator_state_hooks(PyObject* get, PyObject* set) {
  g_get_state_hook = get;
  g_set_state_hook = set;
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
