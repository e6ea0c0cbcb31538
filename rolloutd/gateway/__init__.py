"""An OpenAI-compatible HTTP endpoint over the episodes rolloutd runs (bring your own agent program).

* :mod:`.server`: the :class:`~.server.Gateway` (sessions, routes, answers; the module doc
  says what a session serves);
* :mod:`.schemas`: the requests it serves as pydantic models (the official API's request types,
  the ``openai`` package's ``CompletionCreateParams``) and OpenAI's error shape;
* :mod:`.prompts`: token-in / token-out, the recorded ids a chat call's messages repeat;
* :mod:`.tool_calls`: tool calls parsed out of sampled text (SGLang's ``--tool-call-parser``
  detectors).

docs/gateway.md is the user's guide; :mod:`rolloutd.external_env` runs an agent program against it.
"""
