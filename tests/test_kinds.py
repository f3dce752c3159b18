"""The registry of draft kinds is the one list of them: config, heads, bundles and eval agree with it."""

import torch

from conftest import make_tiny_target
from pipeline import config
from pipeline.heads.models import BUILDERS
from pipeline.kinds import HEAD_KINDS, KINDS, kind_of_method, make_drafter


def test_every_list_of_kinds_is_the_registry():
    assert tuple(KINDS) == config.METHODS
    assert HEAD_KINDS == config.HEAD_KINDS == tuple(BUILDERS)
    for name, kind in KINDS.items():
        assert (kind.load is None) == (kind.trained_by is None) == (kind.bundle_folder is None), name
    assert kind_of_method("eagle_tree:bundle") == (KINDS["eagle"], True)
    assert kind_of_method("draft_model:fp32") == (KINDS["draft_model"], False)


def test_every_kind_makes_a_drafter_of_its_own_name(tmp_path):
    from pipeline.heads.models import build_heads
    from pipeline.models import load_target

    target = load_target(str(make_tiny_target(tmp_path / "t")), device="cpu")
    vocab = torch.arange(target.model.config.vocab_size)
    settings = {"medusa": dict(num_heads=2, num_layers=1), "eagle": dict(feature_layers=[-1], ttt_steps=1),
                "early_exit": dict(exit_layer=1, adapter_rank=4)}
    for name, kind in KINDS.items():
        module = {"ngram": None, "draft_model": target.model}.get(name)
        if name in settings:
            module = build_heads(name, target.model, vocab, settings[name])
        drafter = make_drafter(name, module, target.model)
        assert drafter.name == name
        assert hasattr(drafter, "propose_tree") == kind.trees, name
