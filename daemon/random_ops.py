"""Random numbers per client on the daemon, a mixin of its Executor: seeding a client's
generator, its state (get / set, in program order), freeing the twins of its torch.Generators,
and `drawing_from`, which runs ops that use the default generator as if they drew from the
client's own.
"""
from __future__ import annotations

import contextlib

import torch

from genie.transport.errors import ProtocolError
from genie.transport.protocol import FREE_GENERATORS_OP, RNG_STATE_OP, SEED_OP, SET_RNG_STATE_OP, GeneratorRef, OpCall

from .handles import ClientState


class RandomOps:
    """Handlers of the generator ops. The Executor provides `_resolve` (a state tensor argument)."""

    def _seed(self, client: ClientState, call: OpCall, device: torch.device):
        if len(call.args) != 1 or type(call.args[0]) is not int:
            raise ProtocolError(f"{SEED_OP} takes one integer")
        client.generator(device).manual_seed(call.args[0] & ((1 << 64) - 1))
        return None

    def _free_generators(self, client: ClientState, call: OpCall):
        if call.outs is not None or not all(type(a) is int for a in call.args):
            raise ProtocolError(f"{FREE_GENERATORS_OP} takes generator ids and no output")
        for uid in call.args:
            client.own_generators.pop(uid, None)
        return None

    def _rng_state(self, client: ClientState, call: OpCall, frames: list, device: torch.device):
        """get_rng_state / set_rng_state of this client's generator on `device`, or of the twin of
        one of its torch.Generators (a last argument), in program order (activation checkpointing
        replays dropout with the state saved in the forward)."""
        args = call.args
        if args and type(args[-1]) is GeneratorRef:
            generator, args = client.drawing_generator(args[-1], device), args[:-1]
        else:
            generator = client.generator(device)
        if call.name == RNG_STATE_OP:
            if args or type(call.outs) is not int:
                raise ProtocolError(f"{RNG_STATE_OP} takes [generator] and one output handle")
            state = generator.get_state()
            client.put(call.outs, state)
            return state
        if len(args) != 1 or call.outs is not None:
            raise ProtocolError(f"{SET_RNG_STATE_OP} takes one state tensor, [generator], and no output")
        state = self._resolve(client, args[0], frames, device, 0)
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise ProtocolError(f"{SET_RNG_STATE_OP}: a state is a 1-D uint8 tensor")
        generator.set_state(state.cpu())  # raises on a state of the wrong size for this generator
        return None


_drawing: set[int] = set()  # ids of client generators installed as the default right now (one executor thread)


@contextlib.contextmanager
def drawing_from(generator: torch.Generator, device: torch.device):
    """Run a random op that has no `generator` argument (it draws from the device's default
    generator) as if it drew from `generator`, the client's: its seed (torch.manual_seed) and its
    saved states (activation checkpointing replays dropout with them) then hold for dropout too,
    and clients do not move each other's streams."""
    if id(generator) in _drawing:  # already installed (a replay running ops one by one): nothing to swap
        yield
        return
    default = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    _drawing.add(id(generator))
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        _drawing.discard(id(generator))
        generator.set_state(default.get_state())
        default.set_state(saved)
