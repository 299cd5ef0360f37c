"""The processed-item mirror between the frontend and the engine core (ipc/mm_mirror.py): the client sends an
image's tensors once, then only its hash, and the core takes them from its own copy. Both ends in lockstep
over random traffic with eviction, and a real engine core process through the offline LLM: the same tokens as
the in-process engine, the second send of an image bare, and a bare item the core lacks refused, naming it."""
from __future__ import annotations

import random

import msgspec
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.ipc.messages import EngineCoreInput, EngineCoreRequest, MultiModalFeature, TensorData
from pagedserve.ipc.mm_mirror import MISSING_ITEM, ItemMirror, item_bytes
from pagedserve.ipc.serial import MsgpackDecoder
from pagedserve.tests.helpers.models.tiny_vlm import IMAGE_TOKEN, make_tiny_llava, random_image


def _item(mm_hash: str, size: int) -> MultiModalFeature:
    data = {"pixel_values": TensorData("uint8", [size], bytes([len(mm_hash) % 251]) * size)}
    return MultiModalFeature(modality="image", mm_hash=mm_hash, offset=0, length=1, data=data)


def test_both_ends_hold_the_same_items_over_random_traffic():
    rng = random.Random(0)
    sizes = {f"h{i}": rng.randint(1, 400) for i in range(30)}
    sizes["huge"] = 5000                        # over the budget: never held, always sent whole
    sender, receiver = ItemMirror(1000, keep_data=False), ItemMirror(1000, keep_data=True)
    bare = whole = 0
    for _ in range(300):
        features = [_item(h, sizes[h]) for h in rng.choices(list(sizes), k=rng.randint(1, 4))]
        sent = sender.strip(features)
        got, missing = receiver.fill(sent)
        assert missing is None
        assert got == features                  # every item's tensors back, as sent the first time
        assert sender.used == receiver.used <= 1000
        assert all((h in sender) == (h in receiver) for h in sizes)
        assert "huge" not in sender
        bare += sum(f.data is None for f in sent)
        whole += sum(f.data is not None for f in sent)
    assert bare > 100 and whole > 100           # both hits and evictions happened


def test_a_bare_item_the_core_lacks_is_reported_and_the_rest_taken_in():
    receiver = ItemMirror(1000, keep_data=True)
    a, b = _item("a", 10), _item("b", 20)
    got, missing = receiver.fill([a, msgspec.structs.replace(b, data=None)])
    assert missing == 1 and "a" in receiver and "b" not in receiver and got[0] == a
    assert item_bytes(b.data) == 20
    assert ItemMirror.of_gb(0, keep_data=True) is None


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava_mirror")))


def _prompts() -> list[dict]:
    images = [random_image(seed, 40 + 8 * seed, 50) for seed in range(2)]
    text = f"USER: {IMAGE_TOKEN} what is it?\nASSISTANT:"
    return [{"prompt": text, "multi_modal_data": {"image": [images[i]]}} for i in (0, 1, 0, 0)]


def test_a_core_process_takes_repeated_images_from_its_copy(llava_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    inproc = LLM(llava_dir, dtype="float32", max_model_len=128)
    try:
        expected = [o.outputs[0].token_ids for o in inproc.generate(_prompts(), greedy, use_tqdm=False)]
    finally:
        inproc.shutdown()
    llm = LLM(llava_dir, dtype="float32", max_model_len=128, multiprocess_core=True)
    try:
        client = llm.client
        sent: list[EngineCoreRequest] = []
        send = client.input.send_multipart
        decoder = MsgpackDecoder(EngineCoreInput)
        client.input.send_multipart = lambda frames, **kw: (sent.append(decoder.decode(frames[1:])),
                                                            send(frames, **kw))[1]
        got = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts()]
        assert got == expected
        carried = [[f.data is not None for f in r.mm_features] for r in sent if isinstance(r, EngineCoreRequest)]
        assert carried == [[True], [True], [False], [False]]      # the first image's repeats went bare
        # A bare item the core does not hold (mirrors out of step) is refused, naming the item; both ends start
        # over: the next send carries the tensors again.
        forged = next(r for r in sent if isinstance(r, EngineCoreRequest) and not r.mm_features[0].data)
        bare = msgspec.structs.replace(forged, request_id="forged", mm_features=[
            msgspec.structs.replace(forged.mm_features[0], mm_hash="not-held")])
        send(client._frames(bare), copy=False)
        out = next(o for o in _outputs(client) if o.request_id == "forged")
        assert out.finish_reason == "error" and MISSING_ITEM in out.error and out.error_field == "mm_features[0].data"
        assert forged.mm_features[0].mm_hash not in client.mm_mirror
        assert llm.generate([_prompts()[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
        assert [r for r in sent if isinstance(r, EngineCoreRequest)][-1].mm_features[0].data is not None
    finally:
        llm.shutdown()


def _outputs(client) -> list:
    outs = []
    while (batch := client.get_output(timeout_s=30)) is not None:
        outs.extend(batch.outputs)
        if any(o.request_id == "forged" for o in batch.outputs):
            return outs
    raise AssertionError(f"no answer to the forged request: {outs}")
