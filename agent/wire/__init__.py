"""Wire vocabulary shared by the agent and the control plane: frames, ids, route tokens, sampling parameters, control-channel messages. Imports nothing of ours."""
