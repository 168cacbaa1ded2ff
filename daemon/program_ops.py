"""genie.graph on the daemon, a mixin of its Executor: define a recorded program (every op
checked as when sent one by one), replay it under the numerics settings it was recorded with,
drop it. The programs themselves (segments traced to TorchScript) are in `programs`.
"""
from __future__ import annotations

import contextlib

import torch

from genie.transport import numerics, protocol
from genie.transport.errors import ProtocolError
from genie.transport.protocol import DEFINE_PROGRAM_OP, REPLAY_OP, OpCall, handles_in

from . import ops as op_table
from . import programs
from .handles import ClientState
from .ops import int_arg
from .random_ops import drawing_from


class ProgramOps:
    """Handlers of the program ops. The Executor provides `_numerics` (the settings in force,
    None where this PyTorch cannot read them), `_replayed` and `devices`."""

    def _define(self, client: ClientState, call: OpCall):
        if (len(call.args) not in (2, 3) or type(call.args[0]) is not int or not isinstance(call.args[1], list)
                or call.args[0] in client.programs):
            raise ProtocolError(f"{DEFINE_PROGRAM_OP} takes [new program id, [[ops, frees], ...], settings?]")
        program_id, raw = call.args[:2]
        # The numerics settings its ops were recorded under (absent: PyTorch's defaults), which
        # every replay runs under, as a CUDA graph keeps the kernels chosen at capture.
        recorded = numerics.parse(call.args[2]) if len(call.args) == 3 else None
        if len(client.programs) >= programs.MAX_PROGRAMS:
            raise ProtocolError(f"a client may keep at most {programs.MAX_PROGRAMS} programs; drop some "
                                "(del the genie.Graph)")
        batches, writes, total, seeded = [], set(), 0, False
        for entry in raw:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ProtocolError(f"{DEFINE_PROGRAM_OP}: each batch is [ops, frees]")
            parsed = protocol.parse_exec({"ops": entry[0], "frees": entry[1]})
            for op_call in parsed.ops:
                op = op_table.resolve(op_call.name)  # aten only: transfers, KV and control ops are not replayable
                op_table.check_call(op, op_call.args, op_call.kwargs)
                # Replayed, random ops draw from the default generator, with or without a generator argument.
                seeded = seeded or op_table.seeded(op)
                writes.update(handles_in(op_call.outs))
            total += len(parsed.ops)
            batches.append((parsed.ops, parsed.frees))
        if total > protocol.MAX_OPS_PER_EXEC:
            raise ProtocolError(f"a program of {total} ops exceeds {protocol.MAX_OPS_PER_EXEC}")
        program = programs.Program(batches, writes, seeded, recorded)
        program.compiled = programs.compile_program(batches, self.devices)
        client.programs[program_id] = program
        for handle in writes:
            client.program_handles.setdefault(handle, []).append(program)
        return None

    def _replay(self, client: ClientState, call: OpCall, device: torch.device):
        program = client.programs.get(int_arg(call, 0)) if len(call.args) == 1 else None
        if program is None:
            raise ProtocolError(f"{REPLAY_OP}: no such program")
        self._replayed.append(program)
        with self._numerics_of(program):
            if program.seeded:  # dropout in a replayed step draws from this client's generator, as when run op by op
                with drawing_from(client.generator(device), device):
                    programs.replay(self, client, program, device)
            else:
                programs.replay(self, client, program, device)
        return None

    def _use_numerics(self, wanted: list) -> None:
        """Put these numerics settings in force (wire form, checked), unless they already are."""
        if wanted != self._numerics:
            try:
                numerics.apply(wanted)
            except BaseException:  # PyTorch refused one: the request fails with its reason
                self._numerics = numerics.read()  # what is in force now, part-applied or not
                raise
            self._numerics = wanted

    @contextlib.contextmanager
    def _numerics_of(self, program):
        """The program's recorded settings in force while it replays, the request's again after."""
        if self._numerics is None:
            yield
            return
        before = self._numerics
        try:
            self._use_numerics(program.numerics or numerics.DEFAULT)
            yield
        finally:
            self._use_numerics(before)

    def _drop_program(self, client: ClientState, call: OpCall):
        program = client.programs.pop(int_arg(call, 0), None)
        if program is not None:
            for handle in program.writes:
                users = client.program_handles.get(handle)
                if users is not None:
                    users[:] = [p for p in users if p is not program]
                    if not users:
                        del client.program_handles[handle]
        return None
