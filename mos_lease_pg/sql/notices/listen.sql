-- Start receiving the lease notices of one schema's channel (statements.notice_channel).
LISTEN {channel}
