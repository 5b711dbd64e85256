"""Output dataclasses: vLLM field names, finished(), readable repr."""

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


def test_completion_and_request_output():
    lp = [{5: Logprob(logprob=-0.1, rank=1, decoded_token="hi")}]
    comp = CompletionOutput(index=0, text="hi", token_ids=[5], cumulative_logprob=-0.1, logprobs=lp)
    assert not comp.finished() and comp.stop_reason is None
    comp.finish_reason = "stop"
    assert comp.finished()
    req = RequestOutput("r1", "say", [1, 2], None, [comp], finished=True)
    text = repr(req)
    assert text.startswith("RequestOutput(request_id=r1, prompt='say', prompt_token_ids=[1, 2]")
    assert "CompletionOutput(index=0, text='hi', token_ids=[5]" in text
    assert "finish_reason=stop" in text and text.endswith("finished=True)")
    assert Logprob(-1.0).rank is None and Logprob(-1.0).decoded_token is None
