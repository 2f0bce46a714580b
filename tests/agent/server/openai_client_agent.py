"""A separate process that plays an external agent with the real `openai` client (used by
test_rollout_server.py): takes N tasks, runs two chat turns each (the second after a user message),
finishes with a reward, and tries a few bad requests. Writes everything it saw to a JSON file.

    python openai_client_agent.py BASE_URL N OUT.json AGAIN_IDS_JSON

Trajectory 2 uses /v1/completions (token ids; AGAIN_IDS: the ids it adds before its second turn).
"""

import json
import sys


def main() -> None:
    import pytest  # the checker of tests/test_optional_imports.py wants the skip; the test skips first

    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")

    url, n, out_path, again = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    record = {"trajectories": [], "errors": {}}
    for k in range(n):
        task = httpx.post(f"{url}/hybridrl/tasks", json={"wait_s": 60}, timeout=90).json()
        tid, msgs = task["trajectory_id"], list(task["messages"])
        turns = []
        for turn in range(2):
            if k == 2:  # the completions endpoint, token ids in: the same trajectory shape
                ids = (
                    task["prompt_token_ids"]
                    if turn == 0
                    else turns[0]["prompt_token_ids"] + turns[0]["token_ids"] + again
                )
                r = client.completions.create(model="policy", prompt=ids, user=tid, logprobs=1, max_tokens=12)
                c = r.choices[0]
                d = c.model_dump()
                turns.append({"prompt_token_ids": r.model_extra["prompt_token_ids"], "token_ids": d["token_ids"],
                              "logprobs": d["logprobs"]["token_logprobs"], "finish_reason": c.finish_reason, "tool_calls": []})  # fmt: skip
                continue
            kw = {"temperature": task["sampling"]["temperature"]} if k % 2 else {}
            r = client.chat.completions.create(
                model="policy", messages=msgs, user=tid, logprobs=True, max_tokens=12, **kw
            )
            c = r.choices[0]
            d = c.model_dump()
            calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
            turns.append(
                {
                    "prompt_token_ids": r.model_extra["prompt_token_ids"],
                    "token_ids": d["token_ids"],
                    "logprobs": [x["logprob"] for x in d["logprobs"]["content"]],
                    "content": c.message.content,
                    "finish_reason": c.finish_reason,
                    "tool_calls": calls,
                }
            )
            msgs += [
                {"role": "assistant", "content": c.message.content or ""},
                {"role": "user", "content": f"again {turn}"},
            ]
        if k == 0:  # bad requests, through the openai client: the server's status and message
            for name, kwargs in {
                "temperature": {"messages": msgs[:-1], "temperature": 0.123},
                "rewritten_history": {"messages": [{"role": "user", "content": "something else"}]},
                "stream": {"messages": msgs[:-1], "stream": True},
            }.items():
                try:
                    client.chat.completions.create(model="policy", user=tid, **kwargs)
                except openai.APIStatusError as e:
                    record["errors"][name] = [
                        e.status_code,
                        e.body["message"] if isinstance(e.body, dict) else str(e.body),
                    ]
        reward = float(k)
        fin = httpx.post(f"{url}/hybridrl/trajectories/{tid}/finish", json={"reward": reward}, timeout=60)
        record["trajectories"].append({"trajectory_id": tid, "messages": task["messages"], "turns": turns,
                                       "reward": reward, "finish_status": fin.status_code})  # fmt: skip
        after = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "user": tid}, timeout=60)
        record["errors"].setdefault("after_finish", [after.status_code, after.json()["error"]["message"]])
    no_id = httpx.post(
        f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=60
    )
    record["errors"]["no_trajectory"] = [no_id.status_code, no_id.json()["error"]["message"]]
    json.dump(record, open(out_path, "w"))


if __name__ == "__main__":
    main()
