"""The server's engine thread on its own: how a step's outputs reach the event loop."""
import asyncio

from nanokv import LLM, SamplingParams
from nanokv.serve.engine_thread import EngineThread
from serving import ENGINE


def test_a_step_hands_its_outputs_to_the_event_loop_in_one_call(model_dir):
    """Each call_soon_threadsafe wakes the event loop: a step of 8 requests makes one, and every
    output arrives, in order, on its group's queue."""
    engine = EngineThread(LLM(str(model_dir), **ENGINE))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def run() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        calls, call = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: calls.append(callback) or call(callback, *args)
        engine.start()
        try:
            _, results = engine.submit([([1 + i, 2, 3], params) for i in range(8)])
            received, finished = [await results.get()], set()
            while len(finished) < 8:
                index, out = await asyncio.wait_for(results.get(), 60)
                received.append((index, out))
                if out.finished:
                    finished.add(index)
        finally:
            engine.stop()
        return len(calls), received

    num_calls, received = asyncio.run(run())
    # the group's request ids, then one a step that had outputs (the eight's, all in step)
    assert num_calls == 1 + (len(received) - 1) // 8 <= 1 + engine.num_steps
    for index in range(8):
        tokens = [len(out.token_ids) for i, out in received[1:] if i == index]
        assert tokens == list(range(1, 13))
