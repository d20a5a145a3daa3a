"""A misspelled keyword of a loader is refused naming it and the keyword it likely means; without a close one the
refusal lists the loader's own keywords before the Hub download's. The keywords are checked before anything is
read, so no model is needed."""

import pytest

from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline, OnnxStreamDiffusionPipeline
from optimum_iobinding.errors import ArgumentError


@pytest.mark.parametrize(
    "keyword, meant",
    [
        ("io_bindng", "io_binding"),
        ("cuda_grpah", "cuda_graph"),
        ("provider_option", "provider_options"),
        ("Sess_Options", "sess_options"),
        ("componet_options", "component_options"),
        ("schedular", "scheduler"),  # a component given in place of the folder's
        ("revison", "revision"),  # the Hub download's
    ],
)
def test_a_misspelled_pipeline_keyword_names_the_one_it_likely_means(tmp_path, keyword, meant):
    with pytest.raises(TypeError) as caught:
        OnnxStableDiffusionPipeline.from_pretrained(tmp_path, **{keyword: False})
    assert isinstance(caught.value, ArgumentError)
    assert f"{keyword}: not a keyword of from_pretrained; did you mean {meant}?" in str(caught.value)


def test_a_keyword_near_none_lists_the_loaders_own_keywords_before_the_hubs(tmp_path):
    with pytest.raises(TypeError) as caught:
        OnnxStableDiffusionPipeline.from_pretrained(tmp_path, zzz=1)
    message = str(caught.value)
    assert "did you mean" not in message
    assert "['zzz']" in message
    own, _, hub = message.partition("huggingface_hub's download keywords")
    for name in ("provider", "sess_options", "io_binding", "cuda_graph", "component_options", "scheduler"):
        assert repr(name) in own
    assert "'revision'" in hub and "'revision'" not in own


def test_several_misspelled_keywords_are_each_named(tmp_path):
    with pytest.raises(TypeError) as caught:
        OnnxStableDiffusionPipeline.from_pretrained(tmp_path, io_bindng=False, zzz=1)
    message = str(caught.value)
    assert "io_bindng: not a keyword of from_pretrained; did you mean io_binding?" in message
    assert "its own keywords are" in message  # zzz is near nothing


def test_a_misspelled_model_keyword_names_the_one_it_likely_means(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"max_graph_signature: not a keyword of from_pretrained; did you mean "
        r"max_graph_signatures\?",
    ):
        IOBindingORTModel.from_pretrained(tmp_path, max_graph_signature=2)
    with pytest.raises(TypeError, match=r"subfoldr: not a keyword of from_pretrained; did you mean subfolder\?"):
        IOBindingORTModel.from_pretrained(tmp_path, subfoldr="unet")


def test_a_misspelled_loading_argument_of_a_family_names_it(tmp_path):
    with pytest.raises(TypeError, match=r"tiny_vea: not a keyword of from_pretrained; did you mean tiny_vae\?"):
        OnnxStreamDiffusionPipeline.from_pretrained(tmp_path, tiny_vea="madebyollin/taesd")


def test_a_misspelled_option_of_each_stream_class_names_it(tmp_path, xl_folder, controlnet_folders):
    for folder in (tmp_path, xl_folder, controlnet_folders["one"]):
        with pytest.raises(TypeError, match=r"io_bindng: not a keyword of from_pretrained; did you mean io_binding\?"):
            OnnxStreamDiffusionPipeline.from_pretrained(folder, io_bindng=False)
