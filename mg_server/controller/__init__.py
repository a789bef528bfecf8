"""The controller process: policy and tau, window checks, audits and verdicts; it starts the
verifier and is the one peer of the front and the seam."""
